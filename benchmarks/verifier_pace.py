"""The verifier benchmark's numbers about pace: how fast the verifier proves and replays, against the trainer,
and the ratios it writes as JSON (benchmarks/verifier_bench.py runs the variants)."""

import statistics


def verifier_pace(commits: dict, complete: dict, train_steps_per_sec: float) -> dict:
    """How the verifier kept pace, from the first commit to the last complete verdict, in steps per second:
    the trainer's steps it proved (the newest step with a complete verdict, less the first commit's step)
    and the steps it replayed (every verdict's `replayed_steps`: its compute), each over the trainer's
    steps/s. The lag: the final commit to its complete verdict."""
    first, last = min(commits), max(commits)
    span = complete[last][0] - commits[first]
    replayed = sum(v["replayed_steps"] for _, v in complete.values())
    return {"proved_steps_per_sec": [(last - first) / span], "replayed_steps_per_sec": [replayed / span],
            "train_steps_per_sec": [train_steps_per_sec], "final_lag_secs": [complete[last][0] - commits[last]],
            "replayed_over_trained": [replayed / last]}


LEVELS = ("intact", "replayed", "resumes", "reproduced")  # checkpointing/_src/verdicts.py's, in the order they prove


def ratios(results: dict, restore: dict, budgets: list[str]) -> dict:
    """The judged and reported ratios as data, per --verify_budgets value (`_budget_<B>` suffixes)."""
    plain = statistics.median(restore["times"])
    gather = lambda budget, key: [x for run in results[budget] for x in run[key]]
    out = {"plain_restore_secs": plain}
    for b in budgets:
        trained = statistics.median(gather(b, "train_steps_per_sec"))
        out.update({f"first_verdict_over_restore_budget_{b}": statistics.median(gather(b, "latency")) / plain,
                    f"complete_verdict_over_restore_budget_{b}": statistics.median(gather(b, "complete_latency"))
                    / plain,
                    f"proved_steps_per_sec_over_trained_budget_{b}":
                        statistics.median(gather(b, "proved_steps_per_sec")) / trained,
                    f"replayed_steps_per_sec_over_trained_budget_{b}":
                        statistics.median(gather(b, "replayed_steps_per_sec")) / trained,
                    f"train_with_verifier_over_alone_budget_{b}": statistics.median(gather(b, "steps_per_sec"))
                    / statistics.median(gather(None, "steps_per_sec")),
                    f"final_lag_secs_budget_{b}": statistics.median(gather(b, "final_lag_secs"))})
    return out
