"""The verifier benchmark's numbers about pace: how fast the verifier proves and replays, against the trainer,
and the ratios it writes as JSON (benchmarks/verifier_bench.py runs the variants)."""

import statistics


def verifier_pace(commits: dict, complete: dict, train_steps_per_sec: float) -> dict:
    """How the verifier kept pace, from the first commit to the newest complete verdict, in steps per second:
    the trainer's steps it proved (the newest committed step with a complete verdict, less the first commit's
    step) and the steps it replayed (every verdict's `replayed_steps`: its compute), each over the trainer's
    steps/s. The lag: the final commit to its complete verdict.

    A run whose final step had no complete verdict within the grace period (a verifier slower than the trainer)
    is measured to the newest step that had one: its final lag is left empty and `unverified_steps` names the
    committed steps without one. Every value is a list (one entry per run; empty where nothing was measured)."""
    first, last = min(commits), max(commits)
    unverified = sorted(set(commits) - set(complete))
    proved = max((s for s in complete if s in commits), default=None)
    if proved is None or complete[proved][0] <= commits[first]:
        return {"proved_steps_per_sec": [], "replayed_steps_per_sec": [], "train_steps_per_sec": [train_steps_per_sec],
                "final_lag_secs": [], "replayed_over_trained": [], "unverified_steps": [unverified]}
    span = complete[proved][0] - commits[first]
    replayed = sum(v["replayed_steps"] for s, (_, v) in complete.items() if s in commits)
    return {"proved_steps_per_sec": [(proved - first) / span], "replayed_steps_per_sec": [replayed / span],
            "train_steps_per_sec": [train_steps_per_sec],
            "final_lag_secs": [complete[last][0] - commits[last]] if last in complete else [],
            "replayed_over_trained": [replayed / last], "unverified_steps": [unverified]}


LEVELS = ("intact", "replayed", "resumes", "reproduced")  # checkpointing/_src/verdicts.py's, in the order they prove


def ratios(results: dict, restore: dict, budgets: list[str]) -> dict:
    """The judged and reported ratios as data, per --verify_budgets value (`_budget_<B>` suffixes); None where no
    run measured the quantity (no final verdict in the grace period)."""
    plain = statistics.median(restore["times"])
    gather = lambda budget, key: [x for run in results[budget] for x in run[key]]
    out = {"plain_restore_secs": plain}
    for b in budgets:
        trained = statistics.median(gather(b, "train_steps_per_sec"))
        out.update({f"first_verdict_over_restore_budget_{b}": _over(gather(b, "latency"), plain),
                    f"complete_verdict_over_restore_budget_{b}": _over(gather(b, "complete_latency"), plain),
                    f"proved_steps_per_sec_over_trained_budget_{b}": _over(gather(b, "proved_steps_per_sec"), trained),
                    f"replayed_steps_per_sec_over_trained_budget_{b}":
                        _over(gather(b, "replayed_steps_per_sec"), trained),
                    f"train_with_verifier_over_alone_budget_{b}": _over(
                        gather(b, "steps_per_sec"), statistics.median(gather(None, "steps_per_sec"))),
                    f"final_lag_secs_budget_{b}": _over(gather(b, "final_lag_secs"), 1.0)})
    return out


def _over(values: list[float], baseline: float) -> float | None:
    """The median of `values` over `baseline`; None where there are none."""
    return statistics.median(values) / baseline if values else None
