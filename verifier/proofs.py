"""The proofs of one checkpoint, on the verifier's own mesh, read only (verifier/verifier.py runs them
over a workdir and writes the verdicts).

Proofs run forward, so that blame lands on the step that is wrong (levels: checkpointing/verdicts.py):
  intact      restore onto the verifier's mesh from an explicit abstract target: the manifest
              matches its digest, every fingerprint its leaf (checked by the service), every value
              is finite and the step counter is the step. Written at once (complete=false).
  reproduced  replay from the newest reproduced predecessor (the run's init for the first
              checkpoint, or the params it imported with --init_from) up to this step: every loss
              the step recorded, and then its whole state, must come out equal (verifier/tolerances.py:
              bit-exact on the recording layout, per-leaf tolerances on another). A proved step
              becomes the next proof's start, so the chain of trust goes back to the seed and the
              final step is proved as soon as it commits.
  replayed    the weaker level when the distance exceeds --replay_steps: the replay compared the
              losses it reached, the step's own state is not proved.
A tampered step fails its own proof; its predecessor stays proved and its successor is proved
from the predecessor. It only reads checkpoints; the one thing it writes is verdicts.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import AxisType

from checkpointing import compare
from checkpointing import fingerprint as fingerprint_lib
from checkpointing import manifest as manifest_lib
from checkpointing import restore as restore_lib
from checkpointing import verdicts
from checkpointing.errors import CheckpointError, FingerprintMismatchError, TreeMismatchError
from checkpointing.service import CheckpointService
from checkpointing.workdir import committed_steps, read_manifest
from trainer.config import MESH_AXES
from runtime import collective
from verifier import identity
from verifier import program as program_lib
from verifier import tolerances

INIT = 0  # replayed_from of a proof that starts at the run's init (no checkpoint is step 0)


@dataclasses.dataclass(frozen=True)
class VerifierOptions:
    workdir: str  # the trainer's workdir (local path or gs://)
    mesh: tuple[tuple[str, int], ...] = ()  # the verifier's own mesh; () means data=<its devices>
    replay_steps: int = 100  # a proof replays at most this many steps (beyond: the weaker 'replayed')
    poll_secs: float = 1.0  # first wait between directory polls in --follow
    max_poll_secs: float = 30.0  # polls back off (x2 when nothing new) up to this


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A proved state the next proof replays from (kept on device, never donated)."""

    step: int
    state: object
    fixed_hash: str
    input_states: list | None = None  # the iterator states saved at `step` (verifier/program.py)


@dataclasses.dataclass(frozen=True)
class HeldStep:
    """An intact step, restored once and held for its replay (its intact verdict is written)."""

    state: object
    manifest: dict
    program: object  # verifier/program.py's protocol
    durations: dict
    input_states: list | None = None


class StepProofs:
    """The proofs of one step: intact (restore and check), then reproduced (replay from an anchor)."""

    def __init__(self, options: VerifierOptions):
        self.options = options
        self._programs: dict[tuple, object] = {}  # (program, fixed_hash) -> the replay program
        self._service = CheckpointService(options.workdir, read_only=True)
        self._anchor: Anchor | None = None  # the newest step this process reproduced
        self._copies: dict[str, object] = {}  # fixed_hash -> jitted copy onto the state shardings
        self._mesh = None
        self._run: dict | None = None  # the manifest naming the run (verifier/identity.py)

    def mesh(self):
        """The verifier's own mesh: --mesh over all its devices (data=<devices> by default)."""
        if self._mesh is None:
            sizes = {**dict.fromkeys(MESH_AXES, 1), **(dict(self.options.mesh) or {"data": jax.device_count()})}
            self._mesh = jax.make_mesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
                                       axis_types=(AxisType.Auto,) * len(MESH_AXES))
        return self._mesh

    def run_manifest(self) -> dict | None:
        """The manifest naming this workdir's run (verifier/identity.py), found once and kept: a
        retention that deletes that step later does not change which run the workdir holds."""
        if self._run is None:
            self._run = identity.run_manifest(self.options.workdir, committed_steps(self.options.workdir))
        return self._run

    def _program_for(self, manifest: dict):
        key = (manifest.get("program"), manifest["fixed_hash"])
        if key not in self._programs:
            self._programs[key] = program_lib.load(manifest, self.mesh())
        return self._programs[key]

    # --- one step ------------------------------------------------------------------------------

    def _intact(self, step: int) -> tuple[dict, HeldStep | None]:
        """(verdict, None) when `step` is not intact (complete), else (its intact verdict, what its
        replay needs, restored once)."""
        durations, started = {}, time.perf_counter()
        manifest = {}
        try:
            manifest = read_manifest(self.options.workdir, step)
            problem = identity.difference(step, manifest, self.run_manifest())
            # Every process restores or none does (a collective): process 0's answer is everyone's.
            if collective.decided_by_primary(lambda: problem is not None):
                return self._verdict(step, manifest, "intact", "fail", problem or f"step {step} is not this run's",
                                     durations), None
            program = self._program_for(manifest)
            state = self._service.restore(step, program.abstract_state).state
            inputs = program_lib.input_states(self.options.workdir, step, program)
        except program_lib.ProgramError as err:
            return self._verdict(step, manifest, "intact", "fail", str(err), durations), None
        except (FingerprintMismatchError, TreeMismatchError) as err:
            return self._verdict(step, manifest, "intact", "fail", str(err), durations,
                                 mismatch=_leaf_mismatch(err)), None
        except CheckpointError as err:
            if step not in committed_steps(self.options.workdir):
                return self._verdict(step, manifest, "intact", "gone", f"deleted while being verified ({err})",
                                     durations), None
            return self._verdict(step, manifest, "intact", "fail", str(err), durations), None
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # anything else wrong inside the manifest
            return self._verdict(step, manifest, "intact", "fail", f"step {step} cannot be proved from its manifest "
                                 f"({type(err).__name__}: {_first_line(err)})", durations), None
        durations["restore"] = time.perf_counter() - started
        problem = _intact_problem(step, state)
        if problem:
            return self._verdict(step, manifest, "intact", "fail", problem.detail, durations,
                                 mismatch=problem.as_dict()), None
        intact = self._verdict(step, manifest, "intact", "pass",
                               f"all {len(manifest['leaves'])} leaf fingerprints equal, every value finite", durations,
                               complete=False)
        return intact, HeldStep(state, manifest, program, durations, inputs)

    def _prove(self, step: int, held: HeldStep, disk_anchor: int | None) -> dict:
        """The complete verdict of an intact step: replayed from the newest proved state before it
        (held here, else `disk_anchor`, a reproduced step on disk, else the run's init)."""
        state, manifest, program, durations = held.state, held.manifest, held.program, held.durations
        anchor = self._anchor_for(step, manifest, program, disk_anchor)
        distance = step - anchor.step
        count = min(distance, self.options.replay_steps)
        recorded = {s: v for s, v in manifest_lib.losses(manifest).items() if anchor.step <= s < anchor.step + count}
        origin = f"step {anchor.step}" if anchor.step != INIT else identity.init_origin(manifest)
        if count == 0 or (count < distance and not recorded):
            return self._verdict(step, manifest, "intact", "pass",
                                 f"fingerprints equal; not replayed: {distance} steps from {origin} exceed "
                                 f"--replay_steps={self.options.replay_steps} and reach none of its recorded losses",
                                 durations)
        # The anchor's save too: a chain of trust that crossed a code change says so instead of passing.
        change = program_lib.code_change(program, self._manifests_between(anchor.step - 1, step) + [manifest])
        if change is not None:  # never reproduced across a code change: the replay would prove other code
            return self._verdict(step, manifest, "intact", "pass",
                                 f"fingerprints equal; not reproduced: the code changed on the way from {origin} "
                                 f"to this step ({change})", durations)
        exact = self._exact(anchor.step, step, manifest, program)
        started = time.perf_counter()
        start_state = self._copy(anchor.state, manifest["fixed_hash"], program)
        batches = program_lib.batches_at(program, anchor.input_states, held.input_states)
        replayed_state, replayed = self._replay(program, start_state, anchor.step, count, batches)
        durations["replay"] = time.perf_counter() - started
        rtol = tolerances.loss_rtol(program, exact)
        mismatch, largest = compare.compare_losses(replayed, recorded, rtol)
        level = "reproduced" if count == distance else "replayed"
        common = dict(max_difference=largest, replayed_from=anchor.step, replayed=count, compared=len(recorded))
        how = "bit-exact" if exact else f"max rel diff {largest:.2e}"
        if mismatch is None and level == "reproduced":
            mismatch = (self._state_mismatch(replayed_state, anchor.state, state, manifest, program, exact)
                        or program_lib.input_mismatch(batches, held.input_states))
        if mismatch is not None:
            return self._verdict(step, manifest, level, "fail", f"replayed from {origin}: {mismatch.detail}", durations,
                                 mismatch=mismatch.as_dict(), **common)
        if level == "replayed":
            return self._verdict(step, manifest, level, "pass",
                                 f"replayed {count} of {distance} steps from {origin}: {len(recorded)} recorded losses "
                                 f"match ({how}); the step's own state is not proved (--replay_steps)", durations,
                                 **common)
        self._anchor = Anchor(step, state, manifest["fixed_hash"], held.input_states)
        return self._verdict(step, manifest, level, "pass",
                             f"replayed {count} steps from {origin}: {len(recorded)} recorded losses match ({how}); "
                             f"state equals the checkpoint leaf by leaf{program_lib.input_note(batches)}", durations,
                             **common)

    def _anchor_for(self, step: int, manifest: dict, program, disk_anchor: int | None) -> Anchor:
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
                    restored = self._service.restore(disk_anchor, program.abstract_state).state
                    self._anchor = Anchor(disk_anchor, restored, fixed_hash,
                                          program_lib.input_states(self.options.workdir, disk_anchor, program))
                    return self._anchor
            except CheckpointError as err:  # deleted or damaged since it was proved: start further back
                logging.warning("proved step %d cannot be restored (%s); replaying from the init", disk_anchor, err)
        # The run's init (the step's identity is the run's: verifier/identity.py); a run started from
        # another run's step (--init_from) takes that step's params, checked against their
        # fingerprints and the digest the run recorded.
        run = self.run_manifest() or manifest
        return Anchor(INIT, restore_lib.fresh_state(program.init_fn, program.abstract_state,
                                                    run.get("init_from")), fixed_hash)

    def _replay(self, program, state, start_step: int, count: int, batches=None):
        return program_lib.replay_losses(program, state, start_step, count, batches)

    def _copy(self, state, fixed_hash: str, program):
        """A fresh copy of a proved state (the step donates its input; the proved one stays)."""
        if fixed_hash not in self._copies:
            self._copies[fixed_hash] = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                                               out_shardings=program.state_shardings)
        return self._copies[fixed_hash](state)

    def _exact(self, first: int, last: int, manifest: dict, program) -> bool:
        """Bit-exact only if every step in (first, last] was recorded on the verifier's layout."""
        layout = (dict(program.mesh.shape), jax.process_count())
        if not tolerances.same_layout(*layout, manifest):
            return False
        try:
            return all(tolerances.same_layout(*layout, read_manifest(self.options.workdir, s))
                       for s in committed_steps(self.options.workdir) if first < s < last)
        except CheckpointError:
            return False

    def _manifests_between(self, first: int, last: int) -> list[dict]:
        """The manifests of the committed steps strictly between `first` and `last` (unreadable: skipped)."""
        found = []
        for other in committed_steps(self.options.workdir):
            if first < other < last:
                try:
                    found.append(read_manifest(self.options.workdir, other))
                except CheckpointError:
                    continue
        return found

    def _state_mismatch(self, replayed, anchor_state, saved, manifest, program, exact) -> compare.Mismatch | None:
        if exact:  # the replay's fingerprints against the ones taken at save time
            actual = fingerprint_lib.fingerprint_tree(replayed)
            for path, leaf in manifest["leaves"].items():
                if actual.get(path) != leaf["fingerprint"]:
                    return compare.Mismatch("leaf", path, leaf["fingerprint"], actual.get(path),
                                            f"leaf {path} differs from the checkpoint (fingerprint "
                                            f"{actual.get(path)} != saved {leaf['fingerprint']})")
            return None
        allowed = tolerances.state_tolerances(replayed, anchor_state, program.state_rtol, manifest["leaves"])
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
        return dict(self.mesh().shape)

def _intact_problem(step: int, state) -> compare.Mismatch | None:
    """What is wrong with a restored state on its own: its counter, or a NaN/Inf in a leaf."""
    try:
        restore_lib.check_step_counter(step, state)
    except CheckpointError as err:
        return compare.Mismatch("leaf", ".step", step, None, str(err))
    bad = compare.nonfinite_leaves(state)
    if bad:
        return compare.Mismatch("leaf", bad[0], None, None,
                                f"leaf {bad[0]} holds NaN or Inf ({len(bad)} leaf(s): {', '.join(bad)})")
    return None


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def _leaf_mismatch(err: Exception) -> dict:
    if isinstance(err, FingerprintMismatchError):
        return {"kind": "leaf", "where": err.path, "expected": err.expected, "actual": err.actual}
    return {"kind": "tree", "where": str(err), "expected": None, "actual": None}
