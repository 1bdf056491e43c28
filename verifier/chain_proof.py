"""The full proof of a checkpoint: a replay from the newest proved state before it up to the step, then
the step's whole state compared (the chain of trust; verifier/proofs.py's docstring has the levels).

ChainProver owns the anchors (the proved states replays start from) and the full replay's comparisons;
verifier/proofs.py's StepProver holds one, and owns the restores, the verdicts and the cheap proof.
"""

import dataclasses
import time
from typing import Callable

import jax
from absl import logging

from checkpointing.verification import compare
from checkpointing.verification import content
from checkpointing.verification import manifest as manifest_lib
from checkpointing.verification import restore as restore_lib
from checkpointing.verification import verdicts
from checkpointing.errors import CheckpointError, CorruptCheckpointError
from runtime import collective
from checkpointing.verification import committed_steps, read_manifest
from verifier import ensemble
from verifier import evidence
from verifier import identity
from verifier import layouts
from verifier import program as program_lib

INIT = 0  # replayed_from of a proof that starts at the run's init (no checkpoint is step 0)

@dataclasses.dataclass(frozen=True)
class Anchor:
    """A proved state the next proof replays from (kept on device, never donated)."""

    step: int
    state: object
    fixed_hash: str
    input_states: list | None = None  # the iterator states saved at `step` (verifier/program.py)
    cheap_only: bool = False  # proved by the cheap proof alone: a full proof failing from it re-proves from older
    root: bool = False  # the first save of new code: a new chain's origin, not a proved step (new_chain)


class _Recorded:
    """A manifest's recorded code in the place of a program's (verifier/program.py code_change compares them)."""

    def __init__(self, manifest: dict):
        self.code = (manifest.get("config") or {}).get("code")


class ChainProver:
    """The full proof and its anchors (see the module docstring), on the verifier's shared ProofContext
    (verifier/context.py); `verdict` builds every verdict it gives (StepProver.verdict's signature)."""

    def __init__(self, context, verdict: Callable[..., dict]):
        self._context = context
        self._options = context.options
        self._verdict = verdict
        self._anchor: Anchor | None = None  # the newest step this process proved

    def proved(self, anchor: Anchor) -> None:
        """`anchor` passed a proof of a proved level: the next full proof may replay from it."""
        self._anchor = anchor

    def prove(self, step: int, held, anchor: Anchor) -> dict:
        """The full proof: replayed from the newest proved state before it (held here, else a proved
        step on disk, else the run's init) up to this step."""
        state, manifest, program, durations = held.state, held.manifest, held.program, held.durations
        distance = step - anchor.step
        count = min(distance, self._options.replay_steps)
        recorded = {s: v for s, v in manifest_lib.losses(manifest).items() if anchor.step <= s < anchor.step + count}
        origin = f"step {anchor.step}" if anchor.step != INIT else identity.init_origin(manifest)
        if anchor.root:
            origin += " (the first save of new code, where its chain of proofs starts)"
        if self.new_chain(step, anchor.step) == step:
            return self._verdict(step, manifest, "reproduced", "inconclusive",
                                 f"fingerprints equal; not reproduced: the first save of new code "
                                 f"({program_lib.announced_change(manifest)}), announced at its resume: the steps "
                                 f"before it were computed by other code; a new chain of proofs starts from it",
                                 durations)
        if count == 0 or (count < distance and not recorded):
            return self._verdict(step, manifest, "intact", "pass",
                                 f"fingerprints equal; not replayed: {distance} steps from {origin} exceed "
                                 f"--replay_steps={self._options.replay_steps} and reach none of its recorded losses",
                                 durations)
        # The anchor's save too: a chain of trust that crossed a change of computation says so instead of
        # passing, and never fails (the replay would prove the other computation, not the step).
        between = self._manifests_between(anchor.step - 1, step, manifest["fixed_hash"])
        change = program_lib.code_change(program, between + [manifest])
        if change is not None:
            return self._verdict(step, manifest, "reproduced", "inconclusive",
                                 f"fingerprints equal; not reproduced: the computation changed on the way from "
                                 f"{origin} to this step ({change})", durations)
        exact = self._exact(anchor.step, step, manifest, program)
        started = time.perf_counter()
        batches = program_lib.batches_at(program, anchor.input_states, held.input_states)
        replayed_state, replayed = self._context.replay(
            program, layouts.copy_onto(anchor.state, program.state_shardings), anchor.step, count, batches)
        self._context.budget.replayed(count)
        level = "reproduced" if count == distance else "replayed"
        if exact:  # the recording layout and platform: the values themselves, bit for bit
            mismatch, largest = compare.compare_losses(replayed, recorded, 0.0)
            if mismatch is None and level == "reproduced":
                mismatch = compare.first_unequal_leaf(replayed_state, state)
            judgement = evidence.exact(mismatch)
        else:  # elsewhere: beyond the noise of a layout change, measured for this interval (verifier/evidence.py)
            largest = compare.largest_relative_difference(replayed, recorded)
            judgement = self._judge_interval(held, anchor, count, recorded, replayed, replayed_state,
                                             with_state=level == "reproduced")
        durations["replay"] = time.perf_counter() - started
        if judgement.status == "pass" and level == "reproduced":
            input_mismatch = program_lib.input_mismatch(batches, held.input_states)
            if input_mismatch is not None:
                judgement = evidence.exact(input_mismatch)
        common = dict(max_difference=largest, replayed_from=anchor.step, replayed=count, compared=len(recorded),
                      judgement=None if exact else judgement)
        status, detail = layouts.verdict_of(judgement, manifest)
        if status != "pass":
            return self._verdict(step, manifest, level, status, f"replayed from {origin}: {detail}", durations,
                                 mismatch=judgement.mismatch(), **common)
        how = "bit-exact" if exact else detail
        if level == "replayed":
            return self._verdict(step, manifest, level, "pass",
                                 f"replayed {count} of {distance} steps from {origin}: {len(recorded)} recorded losses "
                                 f"match ({how}); the step's own state is not proved (--replay_steps)",
                                 durations, **common)
        return self._verdict(step, manifest, level, "pass",
                             f"replayed {count} steps from {origin}: {len(recorded)} recorded losses match and the "
                             f"state equals the checkpoint leaf by leaf ({how}){program_lib.input_note(batches)}",
                             durations, **common)

    def _judge_interval(self, held, anchor: Anchor, count: int, recorded: dict, replayed: dict, replayed_state,
                        with_state: bool) -> evidence.Judgement:
        """The recorded losses (and state) against the replay here and the members of its ensemble
        (verifier/ensemble.py): replays of the same interval perturbed at the rounding level, whose spread
        bounds what a genuine execution on another layout could have recorded."""
        program = held.program
        floors = program_lib.floors(program, from_init=anchor.step == INIT)
        losses, states, scale = [replayed], [replayed_state], 0.0

        def judge() -> evidence.Judgement:
            judgement = evidence.judge_losses(recorded, losses, floors[0])
            if with_state:
                judgement = judgement.add(evidence.judge_leaves(
                    layouts.leaf_numbers(held.state, states, anchor.state), floors[1]))
            judgement.replays, judgement.perturbation = len(losses), scale
            return judgement

        def one_step(on, state):
            batches = program_lib.batches_at(on, anchor.input_states, held.input_states)
            return self._context.replay(on, state, anchor.step, 1, batches)[0]

        for other, perturbation in ensemble.members(program, self._context.other_programs(held.manifest),
                                                    anchor.state, one_step):
            batches = program_lib.batches_at(other, anchor.input_states, held.input_states)
            other_state, other_losses = self._context.replay(
                other, layouts.copy_onto(anchor.state, other.state_shardings), anchor.step, count, batches,
                perturbation)
            self._context.budget.replayed(count)
            losses.append(other_losses)
            states.append(layouts.moved_onto(other_state, program.state_shardings))
            scale = max(scale, perturbation.largest())
            if len(losses) > ensemble.MEMBERS:
                judgement = judge()
                if not judgement.findings or len(losses) > ensemble.MEMBERS + ensemble.CONFIRMING:
                    return judgement
        if len(losses) > 1:
            return judge()
        # No other layout (one device, or --measure_noise=false): no bound is established here, and a bound the
        # program declares is a floor under one, never the bound itself.
        return evidence.Judgement(reason=layouts.NO_OTHER_LAYOUT)

    def _proved_step(self, step: int, manifest: dict, disk_anchor: int | None) -> int:
        """The newest proved step before `step` (held, or `disk_anchor`), else the init."""
        held = self._anchor
        candidates = [INIT] + ([disk_anchor] if disk_anchor is not None and disk_anchor < step else [])
        if held is not None and held.fixed_hash == manifest["fixed_hash"] and held.step < step:
            candidates.append(held.step)
        return max(candidates)

    def anchor_step(self, step: int, manifest: dict, disk_anchor: int | None) -> int:
        """The step anchor_for would start from, without restoring anything."""
        proved = self._proved_step(step, manifest, disk_anchor)
        root = self.new_chain(step, proved)
        return root if root is not None else proved

    def new_chain(self, step: int, after: int) -> int | None:
        """The first save of new code in (after, step]: the newest committed step there that a resume across an
        announced code change saved (trainer/code.py check_resume records `changed_from` in every save of that
        attempt) and whose predecessor, if any is left, was computed by other code. A new chain of proofs
        starts there, since the steps before it were computed by other code. None: no such save."""
        steps = [other for other in committed_steps(self._options.workdir) if other <= step]
        for index in range(len(steps) - 1, -1, -1):
            if steps[index] <= after:
                return None
            manifest = self._readable(steps[index])
            if manifest is None or not program_lib.announces_code_change(manifest):
                continue
            before = self._readable(steps[index - 1]) if index else None
            if before is None or program_lib.code_change(_Recorded(manifest), [before]) is not None:
                return steps[index]
        return None

    def _readable(self, step: int) -> dict | None:
        try:
            return read_manifest(self._options.workdir, step)
        except CheckpointError:  # unreadable: its own verdict says so; it announces nothing here
            return None

    def anchor_for(self, step: int, manifest: dict, program, disk_anchor: int | None) -> Anchor:
        """The newest proved state before `step`: held in memory, else `disk_anchor` restored, else init; or,
        where a save after it and before `step` announced a code change, that save (new_chain), restored."""
        fixed_hash = manifest["fixed_hash"]
        root = self.new_chain(step, self._proved_step(step, manifest, disk_anchor))
        if root is not None and root < step:
            # Restored like any step (its fingerprints checked); it is the new chain's origin as the init is
            # the run's: the replay from it proves the steps after it, never the root itself.
            restored = self._context.service.restore(root, program.abstract_state).state
            self._anchor = Anchor(root, restored, fixed_hash,
                                  program_lib.input_states(self._options.workdir, root, program), root=True)
            return self._anchor
        held = self._anchor
        if held is not None and held.fixed_hash == fixed_hash and held.step < step and (
                disk_anchor is None or held.step >= disk_anchor):
            return held
        if disk_anchor is not None and disk_anchor < step:
            try:
                anchor_manifest = read_manifest(self._options.workdir, disk_anchor)
                if anchor_manifest["fixed_hash"] == fixed_hash:
                    self._anchor = self._restored_anchor(disk_anchor, anchor_manifest, program)
                    return self._anchor
            except CheckpointError as err:  # deleted, damaged or edited since it was proved: start further back
                logging.warning("proved step %d cannot be restored (%s); replaying from the init", disk_anchor, err)
        # The run's init (the step's identity is the run's: verifier/identity.py); a run started from
        # another run's step (--init_from) takes that step's params, checked against their
        # fingerprints and the digest the run recorded.
        run = self._context.run_manifest() or manifest
        return Anchor(INIT, restore_lib.fresh_state(program.init_fn, program.abstract_state,
                                                    run.get("init_from")), fixed_hash)

    def _restored_anchor(self, step: int, manifest: dict, program) -> Anchor:
        """Proved `step` restored from disk as an anchor, its content checked against its verdict's."""
        restored = self._context.service.restore(step, program.abstract_state).state
        self._check_proved_content(step, manifest, restored)
        verdict = verdicts.for_save(self._options.workdir, step, manifest.get("digest")) or {}
        return Anchor(step, restored, manifest["fixed_hash"],
                      program_lib.input_states(self._options.workdir, step, program),
                      cheap_only=verdict.get("level") != "reproduced")

    def reproduced_anchor_before(self, step: int, manifest: dict, program) -> Anchor:
        """The newest step before `step` whose full proof passed, restored; else the run's init. Where a full
        proof from an anchor the cheap proof alone proved fails, this is where it is proved again from, so
        that the blame lands on the first wrong step, never on its successor."""
        workdir = self._options.workdir
        for older in reversed([s for s in verdicts.proved_steps(workdir, committed_steps(workdir)) if s < step]):
            try:
                older_manifest = read_manifest(workdir, older)
                verdict = verdicts.for_save(workdir, older, older_manifest.get("digest")) or {}
                if verdict.get("level") == "reproduced" and older_manifest["fixed_hash"] == manifest["fixed_hash"]:
                    return self._restored_anchor(older, older_manifest, program)
            except CheckpointError as err:
                logging.warning("proved step %d cannot anchor a proof again (%s); looking further back", older, err)
        run = self._context.run_manifest() or manifest
        return Anchor(INIT, restore_lib.fresh_state(program.init_fn, program.abstract_state, run.get("init_from")),
                      manifest["fixed_hash"])

    def _check_proved_content(self, step: int, manifest: dict, state) -> None:
        """A proved step restored from disk must hold the content its verdict proved (checkpointing/_src/content.py):
        arrays edited since, the manifest untouched, pass the fingerprints but never anchor a proof. Its verdict
        is replaced by the failure (evidence: the step on disk is not the one proved)."""
        verdict = verdicts.for_save(self._options.workdir, step, manifest.get("digest")) or {}
        changed = content.differing(state, verdict.get("content_sha256") or {}) if jax.process_index() == 0 else []
        if not collective.decided_by_primary(lambda: bool(changed)):
            return
        detail = (f"leaf {changed[0] if changed else '?'} is not the content its {verdict.get('level')} verdict "
                  f"proved ({len(changed) or 'some'} leaf(s) differ): edited after the proof")
        if jax.process_index() == 0:
            logging.error("verdict step %d: intact fail: %s", step, detail)
            verdicts.write(self._options.workdir, self._verdict(step, manifest, "intact", "fail", detail, {},
                                                                 mismatch={"kind": "leaf", "where": changed[0],
                                                                           "expected": None, "actual": None}),
                           replace=True)  # evidence that the verdict no longer describes the step on disk
        raise CorruptCheckpointError(f"step {step}: {detail}")

    def _exact(self, first: int, last: int, manifest: dict, program) -> bool:
        """Bit-exact only if every step of this run in (first, last] was recorded on the verifier's layout and
        platform. A step between them that is not a save of this run's (unreadable, damaged, copied in under
        another number, another run's) says nothing of the layouts that computed the interval: it never turns
        the bit-for-bit comparison into a tolerance."""
        if not layouts.same_layout(program.mesh, manifest):
            return False
        for other in committed_steps(self._options.workdir):
            if not first < other < last:
                continue
            try:
                between = read_manifest(self._options.workdir, other)
            except CheckpointError as err:
                logging.warning("step %d between %d and %d is not read (%s): it does not decide how they compare",
                                other, first, last, err)
                continue
            if between["fixed_hash"] == manifest["fixed_hash"] and not layouts.same_layout(program.mesh, between):
                return False
        return True

    def _manifests_between(self, first: int, last: int, fixed_hash: str) -> list[dict]:
        """The manifests of this run's committed steps strictly between `first` and `last`: unreadable ones and
        another run's (its own verdict fails it) say nothing of the code that computed this run's interval."""
        found = []
        for other in committed_steps(self._options.workdir):
            if first < other < last:
                try:
                    manifest = read_manifest(self._options.workdir, other)
                except CheckpointError:
                    continue
                if manifest["fixed_hash"] == fixed_hash:
                    found.append(manifest)
        return found
