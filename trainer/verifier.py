"""The verifier: proves each committed checkpoint on its own mesh, read-only, and writes verdicts.

Proofs run forward, so that blame lands on the step that is wrong (levels: checkpointing/verdicts.py):
  intact      restore onto the verifier's mesh from an explicit abstract target: the manifest
              matches its digest, every fingerprint its leaf (checked by the service), every value
              is finite and the step counter is the step. Written at once (complete=false).
  reproduced  replay from the newest reproduced predecessor (the config's init for the first
              checkpoint) up to this step: every loss the step recorded, and then its whole state,
              must come out equal (trainer/tolerances.py: bit-exact on the recording layout,
              per-leaf tolerances on another). A proved step becomes the next proof's start, so the
              chain of trust goes back to the seed and the final step is proved as soon as it commits.
  replayed    the weaker level when the distance exceeds --replay_steps: the replay compared the
              losses it reached, the step's own state is not proved.
A tampered step fails its own proof; its predecessor stays proved and its successor is proved
from the predecessor. It only reads checkpoints; the one thing it writes is verdicts.
"""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from checkpointing import compare
from checkpointing import fingerprint as fingerprint_lib
from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing.errors import CheckpointError, FingerprintMismatchError, TreeMismatchError
from checkpointing.service import CheckpointService
from checkpointing.workdir import committed_steps, read_manifest
from trainer import loop, tolerances
from trainer.config import TrainConfig, validate
from trainer.program import Program, build_mesh, build_program

INIT = 0  # replayed_from of a proof that starts at the config's init (no checkpoint is step 0)
# Restored, intact steps held for their replays: with the anchor, the replay's own state and the
# step being proved, at most HELD_STATES + 3 states are on the verifier's devices at once.
HELD_STATES = 2
# --follow looks for new commits every this many replayed steps and proves them intact at once.
REPLAY_CHUNK_STEPS = 2


@dataclasses.dataclass(frozen=True)
class VerifierOptions:
    workdir: str  # the trainer's workdir (local path or gs://)
    mesh: tuple[tuple[str, int], ...] = ()  # the verifier's own mesh; () means data=<its devices>
    replay_steps: int = 100  # a proof replays at most this many steps (beyond: the weaker 'replayed')
    poll_secs: float = 1.0  # first wait between directory polls in --follow
    max_poll_secs: float = 30.0  # polls back off (x2 when nothing new) up to this


@dataclasses.dataclass(frozen=True)
class _Anchor:
    """A proved state the next proof replays from (kept on device, never donated)."""

    step: int
    state: object
    fixed_hash: str


class Verifier:
    def __init__(self, options: VerifierOptions):
        self.options = options
        self._programs: dict[str, tuple[Program, CheckpointService]] = {}  # fixed_hash -> both
        self._anchor: _Anchor | None = None  # the newest step this process reproduced
        self._copies: dict[str, object] = {}  # fixed_hash -> jitted copy onto the state shardings
        # step -> what its replay needs (state, manifest, program, durations): intact, verdict written
        self._held: dict[int, tuple] = {}
        self._intact_between_chunks = False  # --follow: prove new commits intact during a replay
        self._proving: int | None = None  # the step whose replay is running

    def _program_for(self, manifest: dict) -> tuple[Program, CheckpointService]:
        key = manifest["fixed_hash"]
        if key not in self._programs:
            config = TrainConfig.from_json(manifest["config"])
            config = validate(config.replace(workdir=self.options.workdir, mesh=self.options.mesh,
                                         resume_from="latest"), jax.device_count(), check_workdir=False)
            program = build_program(config, build_mesh(config))
            self._programs[key] = (program, CheckpointService(self.options.workdir, read_only=True))
        return self._programs[key]

    # --- one step ------------------------------------------------------------------------------

    def _intact(self, step: int) -> tuple[dict, tuple | None]:
        """(verdict, None) when `step` is not intact (complete), else (its intact verdict,
        (state, manifest, program, durations)): what its replay needs, restored once."""
        durations, started = {}, time.perf_counter()
        manifest = {}
        try:
            manifest = read_manifest(self.options.workdir, step)
            program, service = self._program_for(manifest)
            state = service.restore(step, program.abstract_state).state
        except (FingerprintMismatchError, TreeMismatchError) as err:
            return self._verdict(step, manifest, "intact", "fail", str(err), durations,
                                 mismatch=_leaf_mismatch(err)), None
        except CheckpointError as err:
            if step not in committed_steps(self.options.workdir):
                return self._verdict(step, manifest, "intact", "gone", f"deleted while being verified ({err})",
                                     durations), None
            return self._verdict(step, manifest, "intact", "fail", str(err), durations), None
        durations["restore"] = time.perf_counter() - started
        problem = _intact_problem(step, state)
        if problem:
            return self._verdict(step, manifest, "intact", "fail", problem.detail, durations,
                                 mismatch=problem.as_dict()), None
        intact = self._verdict(step, manifest, "intact", "pass",
                               f"all {len(manifest['leaves'])} leaf fingerprints equal, every value finite", durations,
                               complete=False)
        return intact, (state, manifest, program, durations)

    def _prove(self, step, state, manifest, program, durations, disk_anchor) -> dict:
        """The complete verdict of an intact step: replayed from the newest proved state before it
        (held here, else `disk_anchor`, a reproduced step on disk, else the config's init)."""
        anchor = self._anchor_for(step, manifest, program, disk_anchor)
        distance = step - anchor.step
        count = min(distance, self.options.replay_steps)
        recorded = {s: v for s, v in manifest_lib.losses(manifest).items() if anchor.step <= s < anchor.step + count}
        origin = "the config's init" if anchor.step == INIT else f"step {anchor.step}"
        if count == 0 or (count < distance and not recorded):
            return self._verdict(step, manifest, "intact", "pass",
                                 f"fingerprints equal; not replayed: {distance} steps from {origin} exceed "
                                 f"--replay_steps={self.options.replay_steps} and reach none of its recorded losses",
                                 durations)
        exact = self._exact(anchor.step, step, manifest, program)
        started = time.perf_counter()
        start_state = self._copy(anchor.state, manifest["fixed_hash"], program)
        replayed_state, replayed = self._replay(program, start_state, anchor.step, count)
        durations["replay"] = time.perf_counter() - started
        rtol = tolerances.loss_rtol(program.config.model, exact)
        mismatch, largest = compare.compare_losses(replayed, recorded, rtol)
        level = "reproduced" if count == distance else "replayed"
        common = dict(max_difference=largest, replayed_from=anchor.step, replayed=count, compared=len(recorded))
        how = "bit-exact" if exact else f"max rel diff {largest:.2e}"
        if mismatch is None and level == "reproduced":
            mismatch = self._state_mismatch(replayed_state, anchor.state, state, manifest, program, exact)
        if mismatch is not None:
            return self._verdict(step, manifest, level, "fail", f"replayed from {origin}: {mismatch.detail}", durations,
                                 mismatch=mismatch.as_dict(), **common)
        if level == "replayed":
            return self._verdict(step, manifest, level, "pass",
                                 f"replayed {count} of {distance} steps from {origin}: {len(recorded)} recorded losses "
                                 f"match ({how}); the step's own state is not proved (--replay_steps)", durations,
                                 **common)
        self._anchor = _Anchor(step, state, manifest["fixed_hash"])
        return self._verdict(step, manifest, level, "pass",
                             f"replayed {count} steps from {origin}: {len(recorded)} recorded losses match ({how}); "
                             f"state equals the checkpoint leaf by leaf", durations, **common)

    def _anchor_for(self, step: int, manifest: dict, program: Program, disk_anchor: int | None) -> _Anchor:
        """The newest proved state before `step`: held in memory, else `disk_anchor` restored, else init."""
        fixed_hash = manifest["fixed_hash"]
        held = self._anchor
        if held is not None and held.fixed_hash == fixed_hash and held.step < step and (
                disk_anchor is None or held.step >= disk_anchor):
            return held
        if disk_anchor is not None and disk_anchor < step:
            try:
                anchor_manifest = read_manifest(self.options.workdir, disk_anchor)
                if anchor_manifest["fixed_hash"] == fixed_hash:
                    _, service = self._program_for(anchor_manifest)
                    restored = service.restore(disk_anchor, program.abstract_state).state
                    self._anchor = _Anchor(disk_anchor, restored, fixed_hash)
                    return self._anchor
            except CheckpointError as err:  # deleted or damaged since it was proved: start further back
                logging.warning("proved step %d cannot be restored (%s); replaying from the init", disk_anchor, err)
        return _Anchor(INIT, program.init_fn(), fixed_hash)

    def _copy(self, state, fixed_hash: str, program: Program):
        """A fresh copy of a proved state (the step donates its input; the proved one stays)."""
        if fixed_hash not in self._copies:
            self._copies[fixed_hash] = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                                               out_shardings=program.state_shardings)
        return self._copies[fixed_hash](state)

    def _exact(self, first: int, last: int, manifest: dict, program: Program) -> bool:
        """Bit-exact only if every step in (first, last] was recorded on the verifier's layout."""
        layout = (dict(program.mesh.shape), jax.process_count())
        if not tolerances.same_layout(*layout, manifest):
            return False
        try:
            return all(tolerances.same_layout(*layout, read_manifest(self.options.workdir, s))
                       for s in committed_steps(self.options.workdir) if first < s < last)
        except CheckpointError:
            return False

    def _state_mismatch(self, replayed, anchor_state, saved, manifest, program, exact) -> compare.Mismatch | None:
        if exact:  # the replay's fingerprints against the ones taken at save time
            actual = fingerprint_lib.fingerprint_tree(replayed)
            for path, leaf in manifest["leaves"].items():
                if actual.get(path) != leaf["fingerprint"]:
                    return compare.Mismatch("leaf", path, leaf["fingerprint"], actual.get(path),
                                            f"leaf {path} differs from the checkpoint (fingerprint "
                                            f"{actual.get(path)} != saved {leaf['fingerprint']})")
            return None
        allowed = tolerances.state_tolerances(replayed, anchor_state, program.config.model, manifest["leaves"])
        return compare.compare_leaves(replayed, saved, allowed)

    def _verdict(self, step, manifest, level, status, detail, durations, *, complete=True, mismatch=None,
                 max_difference=None, replayed_from=None, replayed=0, compared=0) -> dict:
        return verdicts.make(step=step, level=level, status=status, complete=complete, detail=detail,
                             mismatch=mismatch, checkpoint_mesh=manifest.get("mesh", {}),
                             verifier_mesh=self._mesh_shape(), durations_secs=durations,
                             max_relative_difference=max_difference, replayed_from=replayed_from,
                             replayed_steps=replayed, compared_losses=compared,
                             manifest_digest=manifest.get("digest"))

    def _mesh_shape(self) -> dict:
        if self._programs:
            return dict(next(iter(self._programs.values()))[0].mesh.shape)
        return dict(self.options.mesh) or {"data": jax.device_count()}

    # --- the workdir ---------------------------------------------------------------------------

    def pending_steps(self) -> list[int]:
        return self._pending_and_proved()[0]

    def _pending_and_proved(self) -> tuple[list[int], list[int]]:
        """(committed steps without a complete verdict, committed reproduced steps), oldest first.

        Reads the verdicts of committed steps only (retention bounds them), never every verdict a
        long run wrote; a set-aside step's verdict has moved out with it, so a step saved again
        under its number is pending again.
        """
        committed = committed_steps(self.options.workdir)
        found = verdicts.read_steps(self.options.workdir, committed)
        pending = [step for step in committed if step not in found or not found[step]["complete"]]
        return pending, [step for step in committed if verdicts.is_reproduced(found.get(step))]

    def verify_pending(self, max_steps: int | None = None) -> list[dict]:
        """Proves the pending steps (the oldest `max_steps` of them; None: all) once each, writes
        their verdicts and returns the complete ones."""
        plan = self._agreed_plan()
        planned = {step for step, _ in plan}
        for step in [step for step in self._held if step not in planned]:
            del self._held[step]  # deleted or set aside since it was held
        plan = plan[:max_steps]
        return [verdict for first in range(0, len(plan), HELD_STATES)
                for verdict in self._prove_together(plan[first:first + HELD_STATES])]

    def _prove_together(self, plan: list[tuple[int, int | None]]) -> list[dict]:
        """Intact proofs of every step first, each verdict written as soon as it is known, then the
        replays in ascending step order: a step that committed while an older one waited gets its
        intact verdict before that one's replay. Each step is restored once, and its state held
        for its own replay."""
        written = []
        for step, _ in plan:
            verdict = self._hold_if_intact(step)
            if verdict is not None:
                written.append(verdict)
        for step, disk_anchor in plan:
            if step in self._held:  # popped: its state is released once proved
                self._proving = step
                try:
                    verdict = self._prove(step, *self._held.pop(step), disk_anchor)
                finally:
                    self._proving = None
                self._write(verdict)
                written.append(verdict)
        return written

    def _hold_if_intact(self, step: int) -> dict | None:
        """Restores `step` (unless held) and writes its intact verdict; holds its state for the
        replay and returns None, or returns the complete verdict of a step that is not intact."""
        if step in self._held:
            return None
        # Every process takes part: restores and replays are collective; process 0 writes.
        verdict, restored = self._intact(step)
        self._write(verdict)
        if restored is None:
            return verdict
        self._held[step] = restored
        return None

    def _replay(self, program: Program, state, start_step: int, count: int):
        """loop.replay_losses in chunks; under --follow, steps committed meanwhile are proved intact
        (and held) between chunks, so their first verdict does not wait for this whole replay."""
        losses = {}
        for first in range(start_step, start_step + count, REPLAY_CHUNK_STEPS):
            steps = min(REPLAY_CHUNK_STEPS, start_step + count - first)
            state, chunk = loop.replay_losses(program, state, first, steps)
            losses.update(chunk)
            if self._intact_between_chunks and first + REPLAY_CHUNK_STEPS < start_step + count:
                self._prove_new_commits_intact()
        return state, losses

    def _prove_new_commits_intact(self) -> None:
        if len(self._held) >= HELD_STATES:  # the same on every process: they follow one plan
            return
        skip = set(self._held) | {self._proving}
        for step, _ in self._agreed_plan():  # every process the same plan: the restores are collective
            if len(self._held) >= HELD_STATES:
                break
            if step not in skip:
                self._hold_if_intact(step)

    def _write(self, verdict: dict) -> None:
        if jax.process_index() != 0:
            return
        verdicts.write(self.options.workdir, verdict)
        if verdict["complete"]:
            logging.log(logging.ERROR if verdict["status"] == "fail" else logging.INFO,
                        "verdict step %d: %s %s: %s", verdict["step"], verdict["level"], verdict["status"],
                        verdict["detail"])

    def follow(self, stop: threading.Event, until_step: int | None = None) -> list[dict]:
        """Verifies steps as they commit until `until_step` (or the run's final step) is verified."""
        written, delay = [], self.options.poll_secs
        self._intact_between_chunks = True
        while not stop.is_set():
            # A few steps per pass, then a fresh listing: a new commit waits for at most their proofs.
            fresh = self.verify_pending(max_steps=HELD_STATES)
            written += fresh
            if self._finished(until_step):
                break
            if fresh:  # more may be pending already: list again at once, and back off from the start
                delay = self.options.poll_secs
                continue
            stop.wait(delay)
            delay = min(delay * 2, self.options.max_poll_secs)
        return written

    def _agreed_plan(self) -> list[tuple[int, int | None]]:
        """(step, newest reproduced step on disk before it) pairs, decided by process 0 for all.

        Processes listing the directory themselves could see different steps (a commit lands
        between two listings) and then replay different lengths: a deadlock in the collectives.
        """
        plan = []
        if jax.process_index() == 0:
            pending, proved = self._pending_and_proved()
            for step in pending:
                plan.append((step, next((s for s in reversed(proved) if s < step), None)))
        if jax.process_count() == 1:
            return plan
        rows = np.array([[step, -1 if anchor is None else anchor] for step, anchor in plan] or
                        np.zeros((0, 2)), np.int64).reshape(-1, 2)
        count = int(multihost_utils.broadcast_one_to_all(np.int32(len(rows))))
        padded = np.zeros((max(count, 1), 2), np.int32)
        padded[:len(rows)] = rows
        padded = np.asarray(multihost_utils.broadcast_one_to_all(padded))[:count]
        return [(int(step), None if anchor == -1 else int(anchor)) for step, anchor in padded]

    def _finished(self, until_step: int | None) -> bool:
        finished = self._finished_here(until_step) if jax.process_index() == 0 else False
        if jax.process_count() > 1:
            finished = bool(multihost_utils.broadcast_one_to_all(np.int32(finished)))
        return finished

    def _finished_here(self, until_step: int | None) -> bool:
        if self.pending_steps():
            return False
        committed = committed_steps(self.options.workdir)
        if not committed:
            return False
        last = committed[-1]
        if until_step is not None:
            return last >= until_step
        return read_manifest(self.options.workdir, last)["reason"] == "final"


def _intact_problem(step: int, state) -> compare.Mismatch | None:
    """What is wrong with a restored state on its own: its counter, or a NaN/Inf in a leaf."""
    if int(state.step) != step:
        return compare.Mismatch("leaf", ".step", step, int(state.step),
                                f"leaf .step holds {int(state.step)}, the checkpoint is step {step}")
    bad = compare.nonfinite_leaves(state)
    if bad:
        return compare.Mismatch("leaf", bad[0], None, None,
                                f"leaf {bad[0]} holds NaN or Inf ({len(bad)} leaf(s): {', '.join(bad)})")
    return None


def _leaf_mismatch(err: Exception) -> dict:
    if isinstance(err, FingerprintMismatchError):
        return {"kind": "leaf", "where": err.path, "expected": err.expected, "actual": err.actual}
    return {"kind": "tree", "where": str(err), "expected": None, "actual": None}
