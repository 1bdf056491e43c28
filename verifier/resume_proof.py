"""The cheap proof: the checkpoint resumes the run it came from.

The trainer recorded, k steps after the save of S, the losses of steps S .. S+k-1 and each leaf's sum
and norm at S+k (checkpointing/probes.py). Replaying those k steps from the restored checkpoint must
give them back: bit-exact on the layout that recorded the probe, and across layouts within the bounds
the per-leaf state rule implies (verifier/tolerances.py gives T, the largest ||replayed - trainer's||
allowed for the leaf; then |norm difference| <= T and |sum difference| <= sqrt(n) T). It costs k steps
whatever the save interval, so it keeps pace at any scale. Seed 003's broken resumes fail it: a
restarted step index at the first loss (and the step counter's sum), zeroed Adam moments at the
second loss and in the moments' norms at S+k, a sign-flipped moment in the sums.
"""

import dataclasses
import math

import jax

from checkpointing import compare
from checkpointing import probes
from verifier import program as program_lib
from verifier import tolerances


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    mismatch: compare.Mismatch | None
    steps: int  # replayed
    summary_step: int  # the step whose state summaries were compared
    compared_losses: int
    largest: float  # the largest relative loss difference
    exact: bool

    def describe(self) -> str:
        how = "bit-exact" if self.exact else f"max rel diff {self.largest:.2e}"
        if self.mismatch is not None:
            return f"does not resume the run: replaying its {self.steps} recorded steps: {self.mismatch.detail}"
        return (f"resumes the run: {self.steps} steps replayed from it give the trainer's {self.compared_losses} "
                f"losses after it and its per-leaf sums and norms at step {self.summary_step} ({how})")


def prove(replay, program, start_state, start_copy, step: int, probe: dict, leaves: dict, layout: tuple,
          batches=None) -> ResumeResult:
    """Replays the probe's window from `start_copy` (a copy of the restored `start_state`: the step may
    donate it) with `replay(program, state, first, count, batches) -> (state, {step: loss})`, and compares.
    `batches`: the iterator a program that replays from saved input states reads (verifier/program.py)."""
    count = probe["summary_step"] - step
    exact = tolerances.same_layout(*layout, probe)
    recorded_pass = probe.get("summary_pass", probes.SEPARATE_PASS)
    # Summaries computed inside the trainer's step are computed inside the replay's last step too: the
    # same executable, so the same numbers on the same layout. Host summaries are recomputed on the host.
    in_step = recorded_pass == probes.STEP_PASS and hasattr(program.step_fn, "with_marks")
    replayed_state, replayed = replay(program, start_copy, step, count - 1 if in_step else count, batches)
    if in_step:
        replayed_state, replayed[step + count - 1], summaries = program_lib.replay_marked_step(
            program, replayed_state, step + count - 1, batches)
        same_pass = True
    elif recorded_pass == probes.HOST_PASS and jax.process_count() == 1:  # this process holds every leaf
        summaries, same_pass = probes.host_summaries(replayed_state), True
    else:
        summaries = probes.to_host(probes.leaf_summaries(replayed_state))
        same_pass = recorded_pass == probes.SEPARATE_PASS
    recorded = probes.losses(probe)
    mismatch, largest = compare.compare_losses(replayed, recorded, tolerances.loss_rtol(program, exact))
    if mismatch is None:
        # A summary pass other than the trainer's sums in its own order: bounded like another layout.
        allowed = None if exact and same_pass else tolerances.state_tolerances(
            replayed_state, start_state, program.state_rtol, leaves)
        mismatch = compare_summaries(summaries, probe["summaries"], allowed, leaves, probe["summary_step"])
    return ResumeResult(mismatch, count, probe["summary_step"], len(recorded), largest, exact)


def compare_summaries(actual: dict, recorded: dict, allowed: dict | None, leaves: dict,
                      step: int) -> compare.Mismatch | None:
    """The first leaf whose (sum, norm) differs from the trainer's: equal when `allowed` is None (the same
    layout), else within the bounds of each leaf's allowed ||difference||. NaN and Inf fail."""
    for path in sorted(set(actual) | set(recorded)):
        if path not in actual or path not in recorded:
            return compare.Mismatch("leaf", path, None, None, f"leaf {path} is in only one of the replayed state "
                                    f"and the trainer's summaries of step {step}")
        (got_sum, got_norm), (want_sum, want_norm) = actual[path], recorded[path]
        if allowed is None:
            bounds = (0.0, 0.0)
        else:
            size = math.prod(leaves[path]["shape"]) if path in leaves else 1
            bounds = (allowed[path] * math.sqrt(max(size, 1)), allowed[path])
        for name, got, want, bound in (("sum", got_sum, want_sum, bounds[0]), ("norm", got_norm, want_norm, bounds[1])):
            difference = abs(got - want)
            ok = got == want if bound == 0.0 else compare.within(difference, bound)
            if not (ok and math.isfinite(got) and math.isfinite(want)):
                return compare.Mismatch("leaf", path, want, got,
                                        f"leaf {path} at step {step}: replayed {name} {got!r}, the trainer's "
                                        f"{want!r} (allowed difference {bound:.3e})")
    return None
