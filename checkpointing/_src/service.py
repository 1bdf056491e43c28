"""The checkpoint service: Orbax's CheckpointManager with the guarantees the trainer relies on.

- Only committed (finalized) steps exist: listings read the directory, never Orbax's in-memory
  list, which records a step when `save()` is called, before its write has finished.
- A failed background save surfaces as AsyncSaveError at the next check (each step), even though
  Orbax itself only logs it; the step it was writing never becomes committed.
- Every save carries a manifest (JSON) with a fingerprint per leaf; every restore targets an
  explicit abstract tree with the current mesh's shardings, refuses a tree or config mismatch by
  name, and checks every fingerprint exactly.
- `tier="local"` gives the same guarantees to one process's own fast directory, written by every
  process (checkpointing/_src/local_tier.py: which steps are complete, which layout may restore them).
- The preemption decision is the caller's, taken once per step; Orbax asks it again inside
  `save()` and at finalization, and gets the same answer instead of a second runtime query.
"""

import concurrent.futures
import dataclasses
import time
from typing import Callable, Iterable

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers

from checkpointing._src import durable
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marks as marks_lib
from checkpointing._src import input_state
from checkpointing._src import local_tier
from checkpointing._src import orbax_hooks
from checkpointing._src import platform_record
from checkpointing._src import reads
from checkpointing.config import CheckpointConfig
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.checks import check_config_matches, check_fingerprints, check_tree_matches
from checkpointing._src.run_metadata import RunMetadata  # noqa: F401  (here since the service's first version)
from runtime import collective
from checkpointing.errors import (AsyncSaveError, NoSuchCheckpointError, StepAlreadyCommittedError, one_line_cause)


@dataclasses.dataclass(frozen=True)
class Restored:
    state: object
    manifest: dict


_DEFAULT_CONFIG = CheckpointConfig()


class CheckpointService:
    """Saves and restores one run's state tree under `directory`/checkpoints (local path, gs:// or s3://)."""

    def __init__(self, directory: str, config: CheckpointConfig = _DEFAULT_CONFIG, *,
                 run: RunMetadata | None = None, read_only: bool = False,
                 protected_steps: Callable[[list[int]], Iterable[int]] = lambda steps: (),
                 preemption_decision: Callable[[int], bool] = lambda step: False,
                 writer_check: Callable[[int], None] = lambda step: None, tier: str = manifest_lib.PERSISTENT,
                 data_iterator=None):
        if tier not in (manifest_lib.PERSISTENT, manifest_lib.LOCAL):
            raise ValueError(f"tier must be {manifest_lib.PERSISTENT!r} or {manifest_lib.LOCAL!r}, got {tier!r}")
        self.directory = directory if isinstance(directory, workdir_lib.Workdir) else str(directory)  # read once
        self.tier = tier  # local: this process's own directory, written by every process (local_tier.py)
        local = tier == manifest_lib.LOCAL
        self.config = config  # retention and async_save are read here; the cadence is the caller's policy
        self._run = run
        self._writer_check = writer_check  # raises (e.g. LeaseLostError) once this process may no longer write
        self._pending_step: int | None = None
        self.failed_save = False  # a background save of this service failed (its tmp directory may remain)
        self._data_iterator = data_iterator  # saved in every step as one state per process (input_state.py)
        policies = [checkpoint_managers.LatestN(config.max_to_keep), orbax_hooks.ProtectedSteps(protected_steps)]
        if config.keep_every_steps:
            policies.append(checkpoint_managers.EveryNSteps(config.keep_every_steps))
        manager_options = dict(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=config.async_save,
            # Killed saves leave '<step>.orbax-checkpoint-tmp-*' directories; the primary host (on the
            # local tier, every process) removes them at start-up. A reader must never delete anything.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        if local:
            manager_options.update(local_tier.manager_options(self.directory, read_only))
        elif not read_only and jax.process_index() == 0:
            durable.make_dirs(workdir_lib.checkpoints_dir(self.directory))  # Orbax creates it, not durably
        self._manager = orbax_hooks.Manager(
            workdir_lib.checkpoints_dir(self.directory), options=ocp.CheckpointManagerOptions(**manager_options),
            item_names=(workdir_lib.STATE_ITEM, workdir_lib.MANIFEST_ITEM) + (
                (input_state.INPUT_ITEM,) if data_iterator is not None else ()),
            item_handlers=local_tier.item_handlers() if local else None, preemption_decision=preemption_decision)

    # --- listing -------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        return workdir_lib.committed_steps(self.directory)

    def latest_committed_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_manifest(self, step: int) -> dict:
        """The schema-checked manifest of a committed step."""
        self._require_committed(step)
        return workdir_lib.read_manifest(self.directory, step)

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, state, *, losses: dict[int, float], reason: str, extra: dict | None = None,
             fingerprints=None) -> None:
        """Starts saving `state` as `step`; returns once the device-to-host copy is done (async).

        Call on every process. Fingerprints are computed on device and read back by the background
        write (see orbax_hooks.ManifestHandler), so the caller never waits for them: `fingerprints`,
        those on_step dispatched as `state` came in (checkpointing/_src/marking.py), else a pass of their own.
        """
        if self._run is None:
            raise ValueError("a read-only service (no RunMetadata) cannot save")
        self.check_for_errors()
        self._manager.drop_repeated_failure()
        self._writer_check(step)
        # Orbax checks only its own in-memory step list, then deletes whatever is at the step's path
        # before writing (its checkpointer is always called with force=True): a step another writer
        # committed since this manager listed the directory would be rewritten. One stat in the
        # usual case; on an object store an uncommitted leftover of a killed save may still be replaced.
        workdir_lib.fresh_path(self.directory)
        path = workdir_lib.step_dir(self.directory, step)
        if path.exists() and workdir_lib.is_committed(self.directory, step):
            raise StepAlreadyCommittedError(
                f"step {step} is already committed at {path}; a save never overwrites a committed step "
                "(is another writer using this workdir?)", step=step, path=str(path))
        # Dispatched, not waited for. An accelerator computes them while Orbax copies the state to the
        # host; on CPU they would compete with Orbax's blocking work for the same cores, so they are
        # dispatched once that is done (still before save() returns, so before the caller can donate).
        leaves = manifest_lib.leaf_table(state)
        marked, fingerprints = fingerprints, concurrent.futures.Future()
        if marked is not None:  # computed by the step: nothing to dispatch, read in the background
            fingerprints.set_result(None)
        elif not (self.config.async_save and jax.default_backend() == "cpu"):
            orbax_hooks.dispatch_fingerprints(fingerprints, state)  # a synchronous save needs them before it returns
        run = self._run
        local = self.tier == manifest_lib.LOCAL
        tier_fields = local_tier.manifest_fields(state) if local else None
        platform = platform_record.record()  # here: the caller's thread, whose matmul precision computed the state

        def build_manifest() -> dict:
            ints = (marks_lib.fingerprint_ints(marked, list(leaves)) if marked is not None
                    else fingerprints.result().ints())
            return manifest_lib.build(
                step=step, leaves=leaves, fingerprints=ints, losses=losses,
                config=run.config, fixed_hash=run.fixed_hash, fixed_fields=run.fixed_fields, mesh=run.mesh,
                reason=reason, extra=extra, tier_fields=tier_fields,
                identity_fields={"program": run.program, "init_from": run.init_from, "total_steps": run.total_steps},
                platform=platform)

        started = time.perf_counter()
        self._manager.background_failure = None  # any earlier one was raised by check_for_errors above
        try:
            self._manager.save(step, args=ocp.args.Composite(**{
                workdir_lib.STATE_ITEM: local_tier.save_args(state) if local else ocp.args.StandardSave(state),
                workdir_lib.MANIFEST_ITEM: orbax_hooks.ManifestSave(build_manifest),
                **input_state.save_items(self._data_iterator),  # its state is taken here, before save() returns
            }), force=True)  # the caller's policy decided; Orbax's own should_save must not ask again
        except Exception as err:
            fingerprints.cancel()  # if Orbax's background write had started, its manifest fails
            if self._pending_step is None:
                raise
            self._raise_failed(err)  # Orbax first waits for the previous save and re-raises its failure
        self._pending_step = step
        if not fingerprints.done():
            orbax_hooks.dispatch_fingerprints(fingerprints, state)
        if jax.process_index() == 0:
            logging.info("checkpoint: %sstep %d (%s) handed off in %.3fs", "local " if local else "", step, reason,
                         time.perf_counter() - started)

    def check_for_errors(self) -> None:
        """AsyncSaveError if the last background save failed (known at once: orbax_hooks.Manager) or never committed."""
        if self._pending_step is not None and self._manager.background_failure is not None:
            self._raise_failed(self._manager.background_failure)
        try:
            self._manager.check_for_errors()
        except Exception as err:  # Orbax re-raises the background thread's exception as is
            self._raise_failed(err)
        if self._pending_step is not None and not self._manager.is_saving_in_progress():
            step, self._pending_step = self._pending_step, None
            if not workdir_lib.is_committed(self.directory, step):
                self._raise_failed(None, step)

    def saving(self) -> bool:
        """Whether a save is still in flight, as of the last check_for_errors()."""
        return self._pending_step is not None

    def _raise_failed(self, cause, step=None) -> None:
        step = self._pending_step if step is None else step
        self._pending_step = None  # reported once, here
        self.failed_save = True
        self._manager.reported(cause)
        latest = self.latest_committed_step()
        if cause is None:
            cause = self._manager.joined_error()
        reason = one_line_cause(cause) if cause is not None else "it never committed"
        error = AsyncSaveError(
            f"background save of step {step} failed: {reason} (writing {workdir_lib.step_dir(self.directory, step)}); "
            f"the latest committed step is still {latest}")
        error.exit_at_once = jax.process_count() > 1 and self._manager.finalizing()  # see AsyncSaveError
        raise error from cause

    def wait_until_finished(self) -> None:
        """Blocks until the background save (if any) has committed, or raises AsyncSaveError (at once when
        its write failed here, not after the cross-process barrier that follows)."""
        if self._manager.finished_or_failed():
            if self._pending_step is not None:
                self._raise_failed(self._manager.background_failure)
            return  # reported already: its finalize thread may never end (above)
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._raise_failed(err)
        self.check_for_errors()

    def close(self) -> None:
        self.wait_until_finished()
        self._manager.drop_repeated_failure()
        self._manager.close()

    def set_aside(self, steps: Iterable[int]) -> None:
        """Moves committed steps to <workdir>/superseded/<step>-<time>: out of every listing, not deleted.

        Their verdicts move with them: a verdict proves one save, and the resumed run will save
        new steps under the same numbers.
        """
        steps = sorted(steps)
        if steps and (jax.process_index() == 0 or self.tier == manifest_lib.LOCAL):  # local: each its own
            # `steps` are every process's on the local tier (local_tier.any_local_steps): move only our own
            workdir_lib.move_aside(self.directory, steps, only_present=self.tier == manifest_lib.LOCAL)
        if steps:
            collective.barrier("checkpoint_service_set_aside")
            if isinstance(self.directory, workdir_lib.Workdir):  # every process: process 0 moved them
                self.directory.changed()
            self._manager.reload()

    # --- restoring -----------------------------------------------------------------------------

    def restore(self, step: int, abstract_state) -> Restored:
        """Restores `step` onto the shardings in `abstract_state`, or raises naming what is wrong.

        The tree and the fixed config are checked against the manifest before any array is read;
        after reading, every leaf's fingerprint must equal the one taken at save time.
        """
        local = self.tier == manifest_lib.LOCAL

        def checked_manifest() -> dict:
            manifest = self.read_manifest(step)
            if local:  # LocalLayoutMismatchError: the caller falls back to the persistent tier
                local_tier.check_layout(step, manifest, abstract_state)
            self.check_compatible(step, manifest, abstract_state)
            return manifest

        # Local copies fail one at a time (a disk, a replica's bytes): every process must take the same
        # way on (local_tier.on_every_process), or one would wait forever in a collective the others left.
        agreed = (lambda part: local_tier.on_every_process(step, part)) if local else (lambda part: part())
        manifest = agreed(checked_manifest)
        # The check's executable: the layout's compiled marks (Checkpointer.prepare), else the pass, compiled
        # on a thread while Orbax reads.
        ahead = None if marks_lib.compiled_for(abstract_state) else fingerprint_lib.CompiledAhead(abstract_state)
        try:
            state = agreed(lambda: self._read_arrays(step, abstract_state))
        finally:
            if ahead is not None:
                ahead.join()  # no thread outlives the restore
        agreed(lambda: check_fingerprints(step, manifest, state))
        return Restored(state=state, manifest=manifest)

    def restore_input(self, step: int) -> None:
        """Sets the data iterator to the position this process saved at `step` (input_state.restore)."""
        input_state.restore(self._manager, step, self._data_iterator, workdir_lib.step_dir(self.directory, step))

    def _read_arrays(self, step: int, abstract_state):
        local = self.tier == manifest_lib.LOCAL
        state_args = local_tier.restore_args(abstract_state) if local else ocp.args.StandardRestore(abstract_state)
        # A damaged file is the step's fault (CorruptCheckpointError); any other read error is retried, then
        # the storage's (reads.py). TensorStore's 60-line spec stays in the chain, out of the line.
        restored = reads.read_retrying(
            lambda: self._manager.restore(step, args=ocp.args.Composite(**{workdir_lib.STATE_ITEM: state_args})),
            f"step {step}: reading its arrays from {workdir_lib.step_dir(self.directory, step)}")
        return restored[workdir_lib.STATE_ITEM]

    def check_compatible(self, step: int, manifest: dict, abstract_state) -> None:
        if self._run is not None:
            check_config_matches(step, manifest, self._run)
        check_tree_matches(step, manifest, abstract_state)

    def _require_committed(self, step: int) -> None:
        if step not in self.committed_steps():
            raise NoSuchCheckpointError(
                f"step {step} is not a committed checkpoint in {self.directory} "
                f"(committed: {self.committed_steps() or 'none'})")
