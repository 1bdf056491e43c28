"""The goodput benchmark's numbers: each relaunch's phases and lost steps read from its log, and the
table of medians and spreads over rounds (benchmarks/goodput_bench.py runs the variants)."""

import os
import re
import statistics
import time

from benchmarks.goodput_events import launch_events, variant_events
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from trainer.metrics import PHASES, parse_phases

PREEMPTED_AT = re.compile(r"preempted at step (\d+)")
RESUMED_FROM = re.compile(r"resumed from step (\d+)")
LOGGED_STEP = re.compile(r"\] step (\d+) loss ")  # the progress line (the loss of step s: s + 1 steps done)
HANDED_OFF = re.compile(r"^\[0\] .*checkpoint: (local )?step \d+ \(\w+\) handed off in (\d+\.\d+)s", re.M)
FIRST_STEP_AT = re.compile(r"^\[0\] I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] phase first_step ", re.M)


def first_step_wall_secs(launched_at: float, log: str) -> float | None:
    """From the relaunch to its first step's loss (absl's local-time stamp of the `first_step` line)."""
    match = FIRST_STEP_AT.search(log)
    if match is None:
        return None
    local = time.localtime(launched_at)
    hours, minutes, secs = int(match[1]), int(match[2]), float(match[3])
    day_start = launched_at - (local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + launched_at % 1)
    return (day_start + hours * 3600 + minutes * 60 + secs - launched_at) % 86400


def count_saves(workdir: str) -> int:
    if workdir.startswith("gs://"):
        return len(committed_steps(workdir))
    directory = str(workdir_lib.checkpoints_dir(workdir))
    return sum(name.isdigit() for name in os.listdir(directory)) if os.path.isdir(directory) else 0


def summarise(variant: str, wall: float, launches: list[tuple[float, str, float]], workdir: str) -> dict:
    """One variant's run from its launches: (time.time() at launch, the launch's log, time.time() at exit)."""
    restarts, recomputed = [], []
    for (_, before, _), (launched_at, after, _) in zip(launches, launches[1:]):
        # Killed: the newest logged step (within --log_every_steps of the step the pod reached).
        reached = ([int(s) for s in PREEMPTED_AT.findall(before)]
                   or [int(s) + 1 for s in LOGGED_STEP.findall(before)])
        resumed = [int(s) for s in RESUMED_FROM.findall(after)] or [0]
        if reached:  # else the SIGTERM came before training: no step was lost, the start-up was
            recomputed.append(max(reached) - resumed[0])
        phases = parse_phases(after)
        if (to_first_step := first_step_wall_secs(launched_at, after)) is not None:
            phases["wall"] = to_first_step
        restarts.append(phases)
    handed_off = [match for _, log, _ in launches for match in HANDED_OFF.findall(log)]
    events = variant_events([launch_events(at, exited, log) for at, log, exited in launches])
    return {"variant": variant, "wall_secs": wall, "launches": len(launches), "restarts": restarts, "events": events,
            "recomputed": recomputed, "saves": count_saves(workdir),
            "blocking_secs": [float(secs) for local, secs in handed_off if not local],
            "local_blocking_secs": [float(secs) for local, secs in handed_off if local]}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def phase_sum(phases: dict[str, float]) -> float:
    return sum(phases.get(name, 0.0) for name in PHASES)


def restart_secs(phases: dict[str, float]) -> float:
    """Relaunch to the first step's loss, excluding nothing (the phases' sum if the stamp is missing)."""
    return phases.get("wall", phase_sum(phases))


def report(rounds: list[dict[str, dict]]) -> tuple[str, dict]:
    """Per variant: goodput and the overhead per save are computed per round (against that round's
    ideal run) and their medians reported; restarts, recomputed steps and blocking pool every round."""
    ideals = [r["ideal"]["wall_secs"] for r in rounds]
    out, rows = {"ideal_wall_secs": statistics.median(ideals), "rounds": len(rounds)}, []
    header = ["variant", "wall s", "goodput", "preemptions", "recomputed/preemption", "restart s",
              "phases sum s", *[f"{p} s" for p in PHASES], "saves", "overhead/save s", "blocking/save s",
              "local saves", "local blocking/save s"]
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        goodputs, per_save = [ideal / r["wall_secs"] for ideal, r in zip(ideals, runs)], []
        for ideal, r in zip(ideals, runs):
            saves = r["saves"] + len(r["local_blocking_secs"])  # both tiers' saves share the overhead
            if saves:
                per_save.append((r["wall_secs"] - ideal - sum(restart_secs(p) for p in r["restarts"])) / saves)
        phases_all = [p for r in runs for p in r["restarts"]]
        restarts = [restart_secs(p) for p in phases_all]
        recomputed = [x for r in runs for x in r["recomputed"]]
        blocking = [x for r in runs for x in r["blocking_secs"]]
        local_blocking = [x for r in runs for x in r["local_blocking_secs"]]
        out[f"goodput_{name}"] = statistics.median(goodputs)
        out[f"goodput_per_round_{name}"] = goodputs
        out[f"recomputed_steps_per_preemption_{name}"] = statistics.mean(recomputed) if recomputed else 0.0
        out[f"restart_secs_median_{name}"] = median(restarts)
        out[f"save_overhead_secs_per_save_{name}"] = median(per_save)
        out[f"save_blocking_secs_median_{name}"] = median(blocking)
        out[f"local_save_blocking_secs_median_{name}"] = median(local_blocking)
        out[f"local_saves_{name}"] = statistics.median(len(r["local_blocking_secs"]) for r in runs)
        phases = [median([p[ph] for p in phases_all if ph in p]) for ph in PHASES]
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        rows.append([name, fmt(statistics.median(r["wall_secs"] for r in runs)), f"{out[f'goodput_{name}']:.3f}",
                     str(len(phases_all)), f"{out[f'recomputed_steps_per_preemption_{name}']:.1f}",
                     fmt(median(restarts)),
                     fmt(median([phase_sum(p) for p in phases_all])), *map(fmt, phases),
                     f"{statistics.median(r['saves'] for r in runs):g}", fmt(median(per_save)), fmt(median(blocking)),
                     f"{out[f'local_saves_{name}']:g}", fmt(median(local_blocking))])
    cached = [p for r in rounds for name, v in r.items() if name != "service_no_cache" for p in v["restarts"]]
    uncached = [p for r in rounds for p in r.get("service_no_cache", {}).get("restarts", [])]
    out["restart_secs_median"] = median([restart_secs(p) for p in cached])
    out["restart_compile_secs_median"] = median([p["compile"] for p in cached if "compile" in p])
    out["restart_secs_median_no_compile_cache"] = median([restart_secs(p) for p in uncached])
    out["restart_compile_secs_median_no_compile_cache"] = median([p["compile"] for p in uncached if "compile" in p])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines), out


def cpu_report(rounds: list[dict[str, dict]], out: dict) -> str:
    """One line: each variant's CPU seconds per run (every process of its pods) and the cores they kept busy;
    and what each service variant's run spent beyond plain Orbax's of the same round, in CPU and in wall time
    (medians of the rounds' differences): where the cores are saturated, extra CPU is wall time lost."""
    names = list(rounds[0])
    if any("cpu_secs" not in r[name] for r in rounds for name in names):
        return ""
    parts = []
    for name in names:
        cpu, busy = [r[name]["cpu_secs"] for r in rounds], [r[name]["cpu_secs"] / r[name]["wall_secs"] for r in rounds]
        out[f"cpu_secs_median_{name}"], out[f"cores_busy_median_{name}"] = median(cpu), median(busy)
        parts.append(f"{name} {median(cpu):.1f} s ({median(busy):.2f} cores)")
    line = f"CPU per run, medians over rounds (cores busy): {', '.join(parts)}."
    for name in [n for n in names if n.startswith("service") and "plain_orbax" in names]:
        cpu = median([r[name]["cpu_secs"] - r["plain_orbax"]["cpu_secs"] for r in rounds])
        wall = median([r[name]["wall_secs"] - r["plain_orbax"]["wall_secs"] for r in rounds])
        out[f"extra_cpu_secs_{name}"], out[f"extra_wall_secs_{name}"] = cpu, wall
        line += f" {name} beyond plain_orbax, per run: {cpu:+.2f} s CPU, {wall:+.2f} s wall."
    return line


def fill_report(fills: list[float], out: dict) -> str:
    """One line: each round's fresh-memory fill time (benchmarks/common.py) beside its implied service /
    plain Orbax ratio, so a drift of the ratio can be set against the machine's."""
    service, plain = out.get("implied_goodput_per_round_service"), out.get("implied_goodput_per_round_plain_orbax")
    ratios = [s / p for s, p in zip(service, plain)] if service and plain else [None] * len(fills)
    pairs = [f"{fill:.2f} s" + ("" if ratio is None else f" ({ratio:.3f})") for fill, ratio in zip(fills, ratios)]
    return (f"A new process filling 256 MiB it never touched, at each round's start (the round's implied service / "
            f"plain Orbax ratio): {', '.join(pairs)}; median {statistics.median(fills):.2f} s." if fills else "")


def targets(out: dict) -> list[str]:
    def check(name: str, left, right, factor: float) -> str:
        if left is None or right is None:
            return f"{name}: not measured"
        holds = left >= factor * right if name.startswith("goodput") else left <= factor * right
        return f"{name}: {'met' if holds else 'MISSED'} ({left:.3f} vs {factor:g} x {right:.3f})"

    return [check("goodput_service >= 0.98 * goodput_plain_orbax", out.get("goodput_service"),
                  out.get("goodput_plain_orbax"), 0.98),
            check("goodput_service >= 0.98 * goodput_plain_orbax, implied by the event costs",
                  out.get("implied_goodput_service"), out.get("implied_goodput_plain_orbax"), 0.98),
            check("goodput_service_auto >= goodput_service", out.get("goodput_service_auto"),
                  out.get("goodput_service"), 1.0),
            check("restart_secs_median <= 0.7 * restart_secs_median_no_compile_cache", out.get("restart_secs_median"),
                  out.get("restart_secs_median_no_compile_cache"), 0.7),
            check("goodput_service_local >= goodput_service", out.get("goodput_service_local"),
                  out.get("goodput_service"), 1.0)]
