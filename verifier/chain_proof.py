"""The full proof of a checkpoint: a replay from the newest proved state before it up to the step, then
the step's whole state compared (the chain of trust; verifier/proofs.py's docstring has the levels).

A base of verifier/proofs.py's StepProofs, which owns the restores, the verdicts and the cheap proof;
this part owns the anchors (the proved states replays start from) and the full replay's comparisons.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
from absl import logging

from checkpointing import compare
from checkpointing import fingerprint as fingerprint_lib
from checkpointing import manifest as manifest_lib
from checkpointing import restore as restore_lib
from checkpointing.errors import CheckpointError
from checkpointing.workdir import committed_steps, read_manifest
from verifier import identity
from verifier import program as program_lib
from verifier import tolerances

INIT = 0  # replayed_from of a proof that starts at the run's init (no checkpoint is step 0)

@dataclasses.dataclass(frozen=True)
class Anchor:
    """A proved state the next proof replays from (kept on device, never donated)."""

    step: int
    state: object
    fixed_hash: str
    input_states: list | None = None  # the iterator states saved at `step` (verifier/program.py)


class ChainProofs:
    """The full proof and its anchors (see the module docstring); StepProofs provides the rest."""

    def _prove_chain(self, step: int, held, anchor: Anchor) -> dict:
        """The full proof: replayed from the newest proved state before it (held here, else a proved
        step on disk, else the run's init) up to this step."""
        state, manifest, program, durations = held.state, held.manifest, held.program, held.durations
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
        self._budget.replayed(count)
        durations["replay"] = time.perf_counter() - started
        # A replay from the init drifts far more than one from a proved step (Adam's first update is
        # ~g/|g|): across layouts it is compared with the program's from-init pair, where it has one.
        from_init = anchor.step == INIT
        rtols = tolerances.for_anchor(program, from_init)
        mismatch, largest = compare.compare_losses(replayed, recorded, tolerances.loss_rtol(program, exact, from_init))
        level = "reproduced" if count == distance else "replayed"
        common = dict(max_difference=largest, replayed_from=anchor.step, replayed=count, compared=len(recorded))
        how = "bit-exact" if exact else f"max rel diff {largest:.2e}"
        within = f" (compared with {rtols.describe()})" if rtols.from_init and not exact else ""
        if mismatch is None and level == "reproduced":
            mismatch = (self._state_mismatch(replayed_state, anchor.state, state, manifest, rtols.state, exact)
                        or program_lib.input_mismatch(batches, held.input_states))
        if mismatch is not None:
            return self._verdict(step, manifest, level, "fail", f"replayed from {origin}: {mismatch.detail}{within}",
                                 durations, mismatch=mismatch.as_dict(), **common)
        if level == "replayed":
            return self._verdict(step, manifest, level, "pass",
                                 f"replayed {count} of {distance} steps from {origin}: {len(recorded)} recorded losses "
                                 f"match ({how}){within}; the step's own state is not proved (--replay_steps)",
                                 durations, **common)
        self._anchor = Anchor(step, state, manifest["fixed_hash"], held.input_states)
        return self._verdict(step, manifest, level, "pass",
                             f"replayed {count} steps from {origin}: {len(recorded)} recorded losses match ({how}); "
                             f"state equals the checkpoint leaf by leaf{within}{program_lib.input_note(batches)}",
                             durations, **common)

    def _anchor_step(self, step: int, manifest: dict, disk_anchor: int | None) -> int:
        """The step _anchor_for would start from, without restoring anything."""
        held = self._anchor
        candidates = [INIT] + ([disk_anchor] if disk_anchor is not None and disk_anchor < step else [])
        if held is not None and held.fixed_hash == manifest["fixed_hash"] and held.step < step:
            candidates.append(held.step)
        return max(candidates)

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

    def _state_mismatch(self, replayed, anchor_state, saved, manifest, state_rtol, exact) -> compare.Mismatch | None:
        if exact:  # the replay's fingerprints against the ones taken at save time
            actual = fingerprint_lib.fingerprint_tree(replayed)
            for path, leaf in manifest["leaves"].items():
                if actual.get(path) != leaf["fingerprint"]:
                    return compare.Mismatch("leaf", path, leaf["fingerprint"], actual.get(path),
                                            f"leaf {path} differs from the checkpoint (fingerprint "
                                            f"{actual.get(path)} != saved {leaf['fingerprint']})")
            return None
        allowed = tolerances.state_tolerances(replayed, anchor_state, state_rtol, manifest["leaves"])
        return compare.compare_leaves(replayed, saved, allowed)
