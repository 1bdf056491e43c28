"""The cheap proof: the checkpoint resumes the run it came from.

The trainer recorded, k steps after the save of S, the losses of steps S .. S+k-1 and each leaf's sum
and norm at S+k (checkpointing/_src/probes.py). Replaying those k steps from the restored checkpoint must
give them back: bit-exact on the layout and platform that recorded the probe; elsewhere within MARGIN
times the noise of a layout change, measured by replaying the same k steps on the verifier's other
layouts (verifier/evidence.py). It costs k steps (twice, across layouts) whatever the save interval, so
it keeps pace at any scale. Seed 003's broken resumes fail it: a restarted step index at the first loss
(and the step counter's sum), zeroed Adam moments at the second loss and in the moments' norms at S+k,
a sign-flipped moment in the sums.
"""

import dataclasses
from typing import Callable, Iterable

import jax

from checkpointing.verification import compare
from checkpointing.verification import probes
from checkpointing.errors import CheckpointError
from checkpointing.verification import committed_steps, read_manifest
from runtime import collective
from verifier import ensemble
from verifier import evidence
from verifier import layouts
from verifier import program as program_lib


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    judgement: evidence.Judgement
    status: str  # pass, fail or inconclusive (verifier/layouts.py verdict_of)
    detail: str
    steps: int  # replayed
    summary_step: int  # the step whose state summaries were compared
    compared_losses: int
    largest: float  # the largest relative loss difference
    exact: bool

    @property
    def mismatch(self) -> evidence.Finding | None:
        """The strongest evidence of a failed proof."""
        return self.judgement.findings[0] if self.status == "fail" else None

    def describe(self) -> str:
        if self.status == "fail":
            return f"does not resume the run: replaying its {self.steps} recorded steps: {self.detail}"
        if self.status == "inconclusive":
            return f"the cheap proof could not decide: {self.detail}"
        how = "bit-exact" if self.exact else self.detail
        return (f"resumes the run: {self.steps} steps replayed from it give the trainer's {self.compared_losses} "
                f"losses after it and its per-leaf sums and norms at step {self.summary_step} ({how})")


def prove(replay, program, start_state, step: int, probe: dict, manifest: dict,
          others: Callable[[], Iterable], batches_for: Callable) -> ResumeResult:
    """Replays the probe's window from a copy of the restored `start_state` with
    `replay(program, state, first, count, batches) -> (state, {step: loss})` and compares; across layouts
    also on the programs `others()` yields (a second, and a third to confirm evidence).
    `batches_for(program)`: the iterator a program that replays from saved input states reads."""
    count = probe["summary_step"] - step
    recorded_pass = probe.get("summary_pass", probes.SEPARATE_PASS)
    recorded = probes.losses(probe)
    losses, summaries, same_pass = _replayed(replay, program, start_state, step, count, recorded_pass,
                                             batches_for(program))
    exact = layouts.same_layout(program.mesh, probe) and layouts.same_platform(manifest)
    largest = compare.largest_relative_difference(losses, recorded)
    leaves = manifest["leaves"]
    sizes = {path: max(1, _size(leaf["shape"])) for path, leaf in leaves.items()}
    integer = {path for path, leaf in leaves.items() if not leaf["dtype"].startswith(("float", "bfloat", "complex"))}
    if exact and same_pass:
        mismatch, _ = compare.compare_losses(losses, recorded, 0.0)
        judgement = evidence.exact(mismatch or _unequal_summary(summaries, probe["summaries"], probe["summary_step"]))
    elif exact:  # the same replay, summed by another pass: only the summation's rounding may differ
        judgement = evidence.judge_losses(recorded, [losses]).add(evidence.judge_summaries(
            probe["summaries"], [summaries], sizes, integer, probe["summary_step"]))
    else:
        floors = program_lib.floors(program, from_init=False)
        all_losses, all_summaries, scale = [losses], [summaries], 0.0

        def judge() -> evidence.Judgement:
            judgement = evidence.judge_losses(recorded, all_losses, floors[0]).add(evidence.judge_summaries(
                probe["summaries"], all_summaries, sizes, integer, probe["summary_step"], floors[1]))
            judgement.replays, judgement.perturbation = len(all_losses), scale
            return judgement

        def one_step(on, state):
            return replay(on, state, step, 1, batches_for(on))[0]

        judgement = None
        for other, perturbation in ensemble.members(program, others(), start_state, one_step):
            other_losses, other_summaries, _ = _replayed(replay, other, start_state, step, count, recorded_pass,
                                                         batches_for(other), perturbation)
            all_losses.append(other_losses)
            all_summaries.append(other_summaries)
            scale = max(scale, perturbation.largest())
            if len(all_losses) > ensemble.MEMBERS:
                judgement = judge()
                if not judgement.findings or len(all_losses) > ensemble.MEMBERS + ensemble.CONFIRMING:
                    break
        if judgement is None and len(all_losses) > 1:
            judgement = judge()
        if judgement is None:  # no other layout: no bound established (a declared one is only a floor)
            judgement = evidence.Judgement(reason=layouts.NO_OTHER_LAYOUT)
    status, detail = layouts.verdict_of(judgement, manifest)
    return ResumeResult(judgement, status, detail, count, probe["summary_step"], len(recorded), largest, exact)


def agreed_probe(workdir: str, step: int, manifest: dict) -> dict | None:
    """The save's probe, if process 0 sees one (every process then replays it: one plan)."""
    probe = probes.for_save(workdir, step, manifest.get("digest"))
    if not collective.decided_by_primary(lambda: probe is not None):
        return None
    return probe or probes.for_save(workdir, step, manifest.get("digest"))


def awaits_probe(options, step: int, final: bool) -> bool:
    """Under --follow with a budget below 1, a save waits for its probe while the trainer may still record it:
    the run's final step is not committed, and no later save has a probe yet. `options`: VerifierOptions."""
    if not options.follow or final or options.verify_budget >= 1.0:
        return False
    for later in (s for s in reversed(committed_steps(options.workdir)) if s > step):
        try:
            later_manifest = read_manifest(options.workdir, later)
        except CheckpointError:
            continue
        if later_manifest.get("reason") == "final" or probes.for_save(options.workdir, later,
                                                                      later_manifest.get("digest")):
            return False
    return True


def _replayed(replay, program, start_state, step: int, count: int, recorded_pass: str, batches, perturb=None):
    """({step: loss}, {key path: [sum, norm]} at step + count, whether summed as the trainer did) of a replay
    of `count` steps on `program` from a copy of `start_state` (a member of the ensemble: `perturb`)."""
    state = layouts.copy_onto(start_state, program.state_shardings)
    # Summaries the trainer took with its step's marks are taken after the replay's last step with the marks'
    # executable too: the same numbers on the same layout. Host summaries are recomputed on the host.
    in_step = recorded_pass == probes.STEP_PASS
    state, losses = replay(program, state, step, count - 1 if in_step else count, batches, perturb)
    if in_step:
        state, losses[step + count - 1], summaries = program_lib.replay_marked_step(
            program, state, step + count - 1, batches)
        return losses, summaries, True
    if recorded_pass == probes.HOST_PASS and jax.process_count() == 1:  # this process holds every leaf
        return losses, probes.host_summaries(state), True
    return losses, probes.to_host(probes.leaf_summaries(state)), recorded_pass == probes.SEPARATE_PASS


def _unequal_summary(actual: dict, recorded: dict, step: int) -> compare.Mismatch | None:
    """The first leaf whose [sum, norm] is not exactly the trainer's (the same layout and pass)."""
    for path in sorted(set(actual) | set(recorded)):
        if actual.get(path) != recorded.get(path):
            return compare.Mismatch("leaf", path, recorded.get(path, [None])[0], actual.get(path, [None])[0],
                                    f"leaf {path} at step {step}: replayed sum and norm {actual.get(path)}, the "
                                    f"trainer's {recorded.get(path)}")
    return None


def _size(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size
