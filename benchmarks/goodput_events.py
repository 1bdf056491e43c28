"""The goodput benchmark's per-event costs, measured directly from each launch's log and exit time.

A variant's wall time is its launches' (start + loop + end) pieces; each piece is read per launch:

- start: from the launch to its first step's loss (the `phase first_step` line's stamp);
- loop: every later step's duration, from process 0's per-step progress lines (the benchmark logs
  every step). The launch's own median step is its clean step; what the steps took beyond
  `clean x steps` is what its saves cost the loop (their blocking and the slowdown while they
  write, on the same cores), divided over the interval saves the launch made;
- end: from the last step's line to the pod's exit (a preempted launch: the preemption save, its
  commit and the exit; the last launch: the final save, its commit and the exit).

So each cost is measured within one launch against that launch's own steps, and machine load that
changes between runs moves no cost but the step time. The goodput these imply uses one ideal wall
time and one step time for every variant, so the ratio of two variants depends on their event
costs alone (see `implied_wall`). `LogProgress` reads a running launch's newest step (the benchmark's
step schedule interrupts on it).
"""

import random
import re
import statistics
import time

STEP_LINE = re.compile(r"^\[0\] I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] step (\d+) loss ", re.M)
FIRST_STEP_AT = re.compile(r"^\[0\] I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] phase first_step ", re.M)
INTERVAL_SAVE = re.compile(r"^\[0\] .*checkpoint: step (\d+) \((?:interval|time|final)\) handed off", re.M)


def stamp_secs(launched_at: float, hours: str, minutes: str, secs: str) -> float:
    """Seconds from `launched_at` (time.time()) to absl's local-time stamp hh:mm:ss.ffffff of that day."""
    local = time.localtime(launched_at)
    day_start = launched_at - (local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + launched_at % 1)
    return (day_start + int(hours) * 3600 + int(minutes) * 60 + float(secs) - launched_at) % 86400


def launch_events(launched_at: float, exited_at: float, log: str) -> dict | None:
    """One launch's start, loop and end pieces (None when it never reached its first step)."""
    first = FIRST_STEP_AT.search(log)
    lines = [(stamp_secs(launched_at, *m.groups()[:3]), int(m[4])) for m in STEP_LINE.finditer(log)]
    if first is None or not lines:
        return None
    start = stamp_secs(launched_at, *first.groups())
    times = [t for t, _ in lines]  # the first line is the first step's, logged just after `first_step`
    durations = [b - a for a, b in zip(times, times[1:])]
    first_step, last_step = lines[0][1], lines[-1][1]
    # A save at counter s runs between step s-1's line and step s's: inside the loop when both are logged.
    loop_saves = sum(first_step < s <= last_step for s in {int(s) for s in INTERVAL_SAVE.findall(log)})
    clean = statistics.median(durations) if durations else 0.0
    return {"start_secs": start, "end_secs": (exited_at - launched_at) - times[-1], "loop_steps": len(durations),
            "clean_step_secs": clean, "loop_secs": sum(durations), "loop_saves": loop_saves,
            "loop_excess_secs": sum(durations) - clean * len(durations)}


def variant_events(launches: list[dict]) -> dict:
    """Per-event costs of one variant's run (its launches' pieces, in order)."""
    pieces = [p for p in launches if p is not None]
    saves = sum(p["loop_saves"] for p in pieces)
    excess = sum(p["loop_excess_secs"] for p in pieces)
    return {"first_start_secs": pieces[0]["start_secs"] if pieces else None,
            "restart_secs": [p["start_secs"] for p in pieces[1:]],
            "preemption_end_secs": [p["end_secs"] for p in pieces[:-1]],
            "finish_secs": pieces[-1]["end_secs"] if pieces else None,
            "save_overhead_secs": excess / saves if saves else None, "loop_saves": saves,
            "clean_step_secs": statistics.median(p["clean_step_secs"] for p in pieces) if pieces else None}


def implied_wall(ideal: dict, costs: dict, counts: dict) -> float:
    """The ideal run's wall time plus every event's cost (per-event medians times the events' counts).

    `ideal` holds the ideal run's wall, first start, finish and step time; `costs` a variant's median
    per-event costs; `counts` how many of each event the variant had (relaunches, preemptions,
    steps lost, interval saves)."""
    return (ideal["wall_secs"] + (costs["first_start_secs"] - ideal["first_start_secs"])
            + counts["relaunches"] * costs["restart_secs"]
            + counts["preemptions"] * (costs["preemption_end_secs"] + costs["lost_steps"] * ideal["clean_step_secs"])
            + counts["saves"] * costs["save_overhead_secs"] + (costs["finish_secs"] - ideal["finish_secs"]))


def spread(values: list[float]) -> dict:
    """The median of per-round values, their range relative to it, and the standard error of their mean
    relative to it (how far the rounds' mean may be from the truth: the resolution of the comparison)."""
    mid = statistics.median(values)
    rel_range = (max(values) - min(values)) / mid if mid else float("nan")
    sem = statistics.stdev(values) / len(values) ** 0.5 / mid if len(values) > 1 and mid else float("nan")
    return {"median": mid, "per_round": values, "relative_range": rel_range, "relative_standard_error": sem}


RATIOS = (("service", "plain_orbax"), ("service_auto", "service"), ("service_local", "service"),
          ("service_no_probe", "service"))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _costs(runs: list[dict]) -> tuple[dict, dict]:
    """A variant's per-event costs (medians over every event of `runs`) and its events' counts."""
    events = [r["events"] for r in runs]
    costs = {"first_start_secs": _median([e["first_start_secs"] for e in events]),
             "restart_secs": _median([x for e in events for x in e["restart_secs"]]) or 0.0,
             "preemption_end_secs": _median([x for e in events for x in e["preemption_end_secs"]]) or 0.0,
             "lost_steps": statistics.mean(x for r in runs for x in r["recomputed"]) if any(
                 r["recomputed"] for r in runs) else 0.0,
             "save_overhead_secs": _median([e["save_overhead_secs"] for e in events]) or 0.0,
             "finish_secs": _median([e["finish_secs"] for e in events]),
             "clean_step_secs": _median([e["clean_step_secs"] for e in events])}
    counts = {"relaunches": statistics.median(r["launches"] - 1 for r in runs),
              "saves": statistics.median(e["loop_saves"] for e in events)}
    counts["preemptions"] = counts["relaunches"]
    return costs, counts


def _ideal(runs: list[dict]) -> dict:
    costs, _ = _costs(runs)
    return {"wall_secs": statistics.median(r["wall_secs"] for r in runs), **costs}


def pooled_ratio(rounds: list[dict[str, dict]], a: str, b: str, counts: dict) -> float:
    """Goodput a / goodput b implied by the per-event costs pooled over `rounds` (one count per event)."""
    ideal = _ideal([r["ideal"] for r in rounds])
    walls = {n: implied_wall(ideal, _costs([r[n] for r in rounds])[0], counts[n]) for n in (a, b)}
    return walls[b] / walls[a]


def bootstrap_error(rounds: list[dict[str, dict]], a: str, b: str, counts: dict, draws: int = 1000) -> float:
    """The pooled ratio's standard error relative to it: its spread over the rounds resampled with
    replacement (a seeded draw, so a report recomputed from the same rounds gives the same number)."""
    if len(rounds) < 2:
        return float("nan")
    rng = random.Random(0)
    ratios = [pooled_ratio(rng.choices(rounds, k=len(rounds)), a, b, counts) for _ in range(draws)]
    return statistics.stdev(ratios) / pooled_ratio(rounds, a, b, counts)


def event_report(rounds: list[dict[str, dict]]) -> tuple[str, dict]:
    """Per-event costs per variant (pooled over rounds), the goodput they imply, and each ratio's spread over
    rounds, implied and measured (the wall-time goodput), as a markdown table and lines."""
    names = [n for n in rounds[0] if n != "ideal"]
    out, implied_rounds = {}, {n: [] for n in names}
    counts = {name: _costs([r[name] for r in rounds])[1] for name in names}  # one count per event, every round
    for r in rounds:
        ideal = _ideal([r["ideal"]])
        for name in names:
            implied_rounds[name].append(ideal["wall_secs"] / implied_wall(ideal, _costs([r[name]])[0], counts[name]))
    ideal = _ideal([r["ideal"] for r in rounds])
    fmt = lambda v, f=".3f": "-" if v is None else format(v, f)
    header = ["variant", "clean step s", "first start s", "restart s / relaunch", "preemption end s / preemption",
              "steps lost / preemption", "save overhead s / save", "finish s", "relaunches", "interval saves",
              "implied goodput", "implied per round"]
    rows = [["ideal", fmt(ideal["clean_step_secs"], ".4f"), fmt(ideal["first_start_secs"]), "-", "-", "-", "-",
             fmt(ideal["finish_secs"]), "0", "0", "1.000", "-"]]
    for name in names:
        costs = _costs([r[name] for r in rounds])[0]
        implied = ideal["wall_secs"] / implied_wall(ideal, costs, counts[name])
        out[f"events_{name}"] = {**costs, **counts[name]}
        out[f"implied_goodput_{name}"] = implied
        out[f"implied_goodput_per_round_{name}"] = implied_rounds[name]
        rows.append([name, fmt(costs["clean_step_secs"], ".4f"), fmt(costs["first_start_secs"]),
                     fmt(costs["restart_secs"]), fmt(costs["preemption_end_secs"]), f"{costs['lost_steps']:.1f}",
                     fmt(costs["save_overhead_secs"]), fmt(costs["finish_secs"]), f"{counts[name]['relaunches']:g}",
                     f"{counts[name]['saves']:g}", f"{implied:.3f}",
                     ", ".join(f"{g:.3f}" for g in implied_rounds[name])])
    out["events_ideal"] = ideal
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    for a, b in RATIOS:
        if a not in names or b not in names:
            continue
        implied = spread([x / y for x, y in zip(implied_rounds[a], implied_rounds[b])])
        measured = spread([r[b]["wall_secs"] / r[a]["wall_secs"] for r in rounds])  # goodput a / goodput b
        out[f"implied_ratio_{a}_over_{b}"], out[f"measured_ratio_{a}_over_{b}"] = implied, measured
        pooled = pooled_ratio(rounds, a, b, counts)
        pooled_error = bootstrap_error(rounds, a, b, counts)
        out[f"implied_ratio_{a}_over_{b}"].update(pooled=pooled, pooled_relative_standard_error=pooled_error)
        for kind, s in (("implied by the event costs", implied), ("measured (wall time)", measured)):
            lines.append(f"{a} / {b}, {kind}: median {s['median']:.3f} over {len(rounds)} rounds "
                         f"({', '.join(f'{v:.3f}' for v in s['per_round'])}), range {100 * s['relative_range']:.1f}%, "
                         f"standard error {100 * s['relative_standard_error']:.1f}%"
                         + (f"; from the pooled event costs {pooled:.3f} (standard error {100 * pooled_error:.1f}% "
                            "over the rounds resampled)" if kind.startswith("implied") else ""))
    return "\n".join(lines), out


class LogProgress:
    """The newest step process 0 has logged in a launch's log (read on from where the last call stopped)."""

    def __init__(self, path: str):
        self._path, self._offset, self._tail, self._newest = path, 0, "", -1

    def newest_step(self) -> int:
        with open(self._path) as f:
            f.seek(self._offset)
            text = self._tail + f.read()
            self._offset = f.tell()
        lines = text.split("\n")
        self._tail = lines.pop()  # a line still being written
        for line in lines:
            if (match := _STEP_LOGGED.search(line)) and line.startswith("[0]"):
                self._newest = max(self._newest, int(match[1]))
        return self._newest


_STEP_LOGGED = re.compile(r"\] step (\d+) loss ")
