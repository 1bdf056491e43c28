"""The checkpoint service: Orbax's CheckpointManager with the guarantees the trainer relies on.

- Only committed (finalized) steps exist: listings read the directory, never Orbax's in-memory
  list, which records a step when `save()` is called, before its write has finished.
- A failed background save surfaces as AsyncSaveError at the next check (each step), even though
  Orbax itself only logs it; the step it was writing never becomes committed.
- Every save carries a manifest (JSON) with a fingerprint per leaf; every restore targets an
  explicit abstract tree with the current mesh's shardings, refuses a tree or config mismatch by
  name, and checks every fingerprint exactly.
- The preemption decision is the caller's, taken once per step; Orbax asks it again inside
  `save()` and at finalization, and gets the same answer instead of a second runtime query.
"""

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Callable, Iterable, Sequence

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from absl import logging
from orbax.checkpoint import checkpoint_managers

from checkpointing import fingerprint as fingerprint_lib
from checkpointing import manifest as manifest_lib
from checkpointing import workdir as workdir_lib
from checkpointing.workdir import fresh_path
from checkpointing.errors import (AsyncSaveError, ConfigMismatchError, CorruptCheckpointError,
                                  FingerprintMismatchError, NoSuchCheckpointError, StepAlreadyCommittedError,
                                  TreeMismatchError)
from checkpointing.errors import one_line_cause



@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    save_every_steps: int = 0  # Save when step % this == 0; 0 disables.
    save_every_secs: float = 0.0  # Save when this long has passed since the last save; 0 disables.
    max_to_keep: int = 5  # The newest this-many committed steps are kept.
    keep_every_steps: int = 0  # Steps that are multiples of this are never deleted; 0 disables.
    async_save: bool = True  # Write in a background thread; the step blocks only for the device-to-host copy.


@dataclasses.dataclass(frozen=True)
class RunMetadata:
    """What every manifest of this run records about the run (the service never interprets `config`)."""

    config: dict
    fixed_fields: dict  # fields a resume must not change
    fixed_hash: str
    mesh: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Restored:
    state: object
    manifest: dict


def _dispatch_fingerprints(into: concurrent.futures.Future, state) -> None:
    """Dispatches the state's fingerprints into `into`, which the manifest waits on, or their error."""
    try:
        into.set_result(fingerprint_lib.tree_fingerprints(state))
    except Exception as err:
        into.set_exception(err)  # the manifest fails with it in the background: the step never commits
        raise


class _ManifestHandler(ocp.handlers.JsonCheckpointHandler):
    """Orbax's JSON handler, but the manifest is built in the background write, not in save().

    The fingerprints are dispatched to the device in save() and only read back here, while
    the arrays are being written, so the step never waits for them. The manifest is still part of
    the same step, so the step commits only once it is written.
    """

    def __init__(self, filename: str | None = None, **kwargs):
        super().__init__(filename or workdir_lib.MANIFEST_FILE, **kwargs)

    # Private in Orbax 0.12 (tests/test_checkpointing.py pins its signature): the one hook that runs
    # inside the background write, where the fingerprints may be awaited without blocking save().
    async def _save_fn(self, x, directory):
        if callable(x):
            x = await asyncio.to_thread(x)  # waits for the fingerprints off the event loop
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(_ManifestHandler, for_save=True)
@dataclasses.dataclass
class _ManifestSave(ocp.args.CheckpointArgs):
    item: Callable[[], dict]  # builds the manifest; called once, in the background


@ocp.args.register_with_handler(_ManifestHandler, for_restore=True)
@dataclasses.dataclass
class _ManifestRestore(ocp.args.CheckpointArgs):
    """Registered because Orbax wants a restore pair; manifests are read with read_manifest()."""


class _ProtectedSteps(checkpoint_managers.PreservationPolicy):
    """Preserves the steps a callback names (e.g. the newest verified step) at deletion time."""

    def __init__(self, protected: Callable[[], Iterable[int]]):
        self._protected = protected

    def should_preserve(self, checkpoints, *, context) -> Sequence[bool]:
        keep = set(self._protected())
        return [info.step in keep for info in checkpoints]


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, answering its own preemption queries from the caller's one decision."""

    def __init__(self, *args, preemption_decision: Callable[[int], bool], **kwargs):
        self._preemption_decision = preemption_decision
        super().__init__(*args, **kwargs)

    def reached_preemption(self, step: int) -> bool:
        return self._preemption_decision(step)


def committed_steps(directory: str) -> list[int]:
    """Finalized steps in `directory`, ascending; in-flight and killed saves are not listed."""
    fresh_path(directory)
    path = workdir_lib.checkpoints_dir(directory)
    if not path.exists():
        return []
    return sorted(ocp.path.step.checkpoint_steps(path))


def read_manifest(directory: str, step: int) -> dict:
    """The schema-checked manifest of `step` (the caller knows the step is committed)."""
    path = workdir_lib.manifest_file(directory, step)
    try:
        text = path.read_text()
    except (OSError, FileNotFoundError) as err:
        raise CorruptCheckpointError(f"step {step}: cannot read its manifest ({err})") from None
    return manifest_lib.parse(text, f"step {step} manifest")


class CheckpointService:
    """Saves and restores one run's state tree under `directory`/checkpoints (local path or gs://)."""

    def __init__(self, directory: str, options: CheckpointOptions = CheckpointOptions(), *,
                 run: RunMetadata | None = None, read_only: bool = False,
                 protected_steps: Callable[[], Iterable[int]] = frozenset,
                 preemption_decision: Callable[[int], bool] = lambda step: False,
                 writer_check: Callable[[int], None] = lambda step: None):
        self.directory = str(directory)
        self.options = options
        self._run = run
        self._writer_check = writer_check  # raises (e.g. LeaseLostError) once this process may no longer write
        self._pending_step: int | None = None
        policies = [checkpoint_managers.LatestN(options.max_to_keep), _ProtectedSteps(protected_steps)]
        if options.keep_every_steps:
            policies.append(checkpoint_managers.EveryNSteps(options.keep_every_steps))
        manager_options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=options.async_save,
            # Killed saves leave '<step>.orbax-checkpoint-tmp-*' directories; the primary host
            # removes them at start-up. A reader must never delete anything.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._manager = _Manager(workdir_lib.checkpoints_dir(self.directory), options=manager_options,
                                 item_names=(workdir_lib.STATE_ITEM, workdir_lib.MANIFEST_ITEM),
                                 preemption_decision=preemption_decision)

    # --- listing -------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        return committed_steps(self.directory)

    def latest_committed_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_manifest(self, step: int) -> dict:
        """The schema-checked manifest of a committed step."""
        self._require_committed(step)
        return read_manifest(self.directory, step)

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, state, *, losses: dict[int, float], reason: str, extra: dict | None = None) -> None:
        """Starts saving `state` as `step`; returns once the device-to-host copy is done (async).

        Call on every process. Fingerprints are computed on device and read back by the background
        write (see _ManifestHandler), so the caller never waits for them.
        """
        if self._run is None:
            raise ValueError("a read-only service (no RunMetadata) cannot save")
        self.check_for_errors()
        self._writer_check(step)
        # Orbax checks only its own in-memory step list, then deletes whatever is at the step's path
        # before writing (its checkpointer is always called with force=True): a step another writer
        # committed since this manager listed the directory would be rewritten. One stat in the
        # usual case; on gs:// an uncommitted leftover of a killed save may still be replaced.
        fresh_path(self.directory)
        path = workdir_lib.step_dir(self.directory, step)
        if path.exists() and step in self.committed_steps():
            raise StepAlreadyCommittedError(
                f"step {step} is already committed at {path}; a save never overwrites a committed step "
                "(is another writer using this workdir?)", step=step, path=str(path))
        # Dispatched, not waited for. An accelerator computes them while Orbax copies the state to the
        # host; on CPU they would compete with Orbax's blocking work for the same cores, so they are
        # dispatched once that is done (still before save() returns, so before the caller can donate).
        fingerprints = concurrent.futures.Future()
        if not (self.options.async_save and jax.default_backend() == "cpu"):
            _dispatch_fingerprints(fingerprints, state)  # a synchronous save needs them before it returns
        run = self._run
        leaves = manifest_lib.leaf_table(state)

        def build_manifest() -> dict:
            return manifest_lib.build(
                step=step, leaves=leaves, fingerprints=fingerprint_lib.to_ints(fingerprints.result()), losses=losses,
                config=run.config, fixed_hash=run.fixed_hash, fixed_fields=run.fixed_fields, mesh=run.mesh,
                reason=reason, extra=extra)

        started = time.perf_counter()
        try:
            self._manager.save(step, args=ocp.args.Composite(**{
                workdir_lib.STATE_ITEM: ocp.args.StandardSave(state),
                workdir_lib.MANIFEST_ITEM: _ManifestSave(build_manifest),
            }), force=True)  # the caller's policy decided; Orbax's own should_save must not ask again
        except Exception as err:
            fingerprints.cancel()  # if Orbax's background write had started, its manifest fails
            if self._pending_step is None:
                raise
            self._raise_failed(err)  # Orbax first waits for the previous save and re-raises its failure
        self._pending_step = step
        if not fingerprints.done():
            _dispatch_fingerprints(fingerprints, state)
        if jax.process_index() == 0:
            logging.info("checkpoint: step %d (%s) handed off in %.3fs", step, reason,
                         time.perf_counter() - started)

    def check_for_errors(self) -> None:
        """Raises AsyncSaveError if the last background save ended without committing its step."""
        try:
            self._manager.check_for_errors()
        except Exception as err:  # Orbax re-raises the background thread's exception as is
            self._raise_failed(err)
        if self._pending_step is not None and not self._manager.is_saving_in_progress():
            step, self._pending_step = self._pending_step, None
            if step not in self.committed_steps():
                self._raise_failed(None, step)

    def saving(self) -> bool:
        """Whether a save is still in flight, as of the last check_for_errors()."""
        return self._pending_step is not None

    def _raise_failed(self, cause, step=None) -> None:
        step = self._pending_step if step is None else step
        self._pending_step = None
        latest = self.latest_committed_step()
        if cause is None:
            # Orbax's finalize thread consumed the error (it is raised once, and Orbax only logs
            # it); joining the finished thread raises it again, so the line can name the cause.
            try:
                self._manager.wait_until_finished()
            except Exception as err:
                cause = err
        reason = one_line_cause(cause) if cause is not None else "it never committed"
        raise AsyncSaveError(
            f"background save of step {step} failed: {reason} (writing {workdir_lib.step_dir(self.directory, step)}); "
            f"the latest committed step is still {latest}") from cause

    def wait_until_finished(self) -> None:
        """Blocks until the background save (if any) has committed, or raises AsyncSaveError."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._raise_failed(err)
        self.check_for_errors()

    def close(self) -> None:
        self.wait_until_finished()
        self._manager.close()

    def set_aside(self, steps: Iterable[int]) -> None:
        """Moves committed steps to <workdir>/superseded/<step>-<time>: out of every listing, not deleted.

        Their verdicts move with them: a verdict proves one save, and the resumed run will save
        new steps under the same numbers.
        """
        steps = sorted(steps)
        if steps and jax.process_index() == 0:
            superseded = workdir_lib.superseded_dir(self.directory)
            superseded.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            for step in steps:
                workdir_lib.step_dir(self.directory, step).rename(superseded / f"{step}-{stamp}")
                verdict = workdir_lib.verdict_file(self.directory, step)
                if verdict.exists():
                    verdict.rename(superseded / f"{step}-{stamp}.verdict.json")
        if steps and jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoint_service_set_aside")
        if steps:
            self._manager.reload()

    # --- restoring -----------------------------------------------------------------------------

    def restore(self, step: int, abstract_state) -> Restored:
        """Restores `step` onto the shardings in `abstract_state`, or raises naming what is wrong.

        The tree and the fixed config are checked against the manifest before any array is read;
        after reading, every leaf's fingerprint must equal the one taken at save time.
        """
        manifest = self.read_manifest(step)
        self.check_compatible(step, manifest, abstract_state)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                workdir_lib.STATE_ITEM: ocp.args.StandardRestore(abstract_state)}))
        except Exception as err:
            # TensorStore's message carries a 60-line spec: the line names the cause, the chain keeps the rest.
            raise CorruptCheckpointError(
                f"step {step}: reading its arrays from {workdir_lib.step_dir(self.directory, step)} failed: "
                f"{one_line_cause(err)}") from err
        state = restored[workdir_lib.STATE_ITEM]
        check_fingerprints(step, manifest, state)
        return Restored(state=state, manifest=manifest)

    def check_compatible(self, step: int, manifest: dict, abstract_state) -> None:
        if self._run is not None:
            check_config_matches(step, manifest, self._run)
        check_tree_matches(step, manifest, abstract_state)

    def _require_committed(self, step: int) -> None:
        if step not in self.committed_steps():
            raise NoSuchCheckpointError(
                f"step {step} is not a committed checkpoint in {self.directory} "
                f"(committed: {self.committed_steps() or 'none'})")


def check_config_matches(step: int, manifest: dict, run: RunMetadata) -> None:
    """ConfigMismatchError naming every fixed field that differs between the checkpoint and `run`."""
    if manifest["fixed_hash"] == run.fixed_hash:
        return
    saved, current = manifest["fixed_fields"], run.fixed_fields
    differing = sorted(name for name in set(saved) | set(current) if saved.get(name) != current.get(name))
    details = ", ".join(f"{name}: checkpoint {saved.get(name)!r} vs this run {current.get(name)!r}"
                        for name in differing)
    raise ConfigMismatchError(f"step {step} was saved with a different config ({details or 'hash differs'})")


def check_tree_matches(step: int, manifest: dict, abstract_state) -> None:
    """TreeMismatchError naming every path added, removed, reshaped or retyped."""
    saved = {path: (leaf["shape"], leaf["dtype"]) for path, leaf in manifest["leaves"].items()}
    target = {path: (leaf["shape"], leaf["dtype"]) for path, leaf in manifest_lib.leaf_table(abstract_state).items()}
    problems = [f"{p} missing from the checkpoint" for p in sorted(set(target) - set(saved))]
    problems += [f"{p} not in this program" for p in sorted(set(saved) - set(target))]
    for path in sorted(set(saved) & set(target)):
        (saved_shape, saved_dtype), (shape, dtype) = saved[path], target[path]
        if saved_shape != shape:
            problems.append(f"{path} shape {saved_shape} in the checkpoint vs {shape}")
        if saved_dtype != dtype:
            problems.append(f"{path} dtype {saved_dtype} in the checkpoint vs {dtype}")
    if problems:
        raise TreeMismatchError(f"step {step} does not match this program's state: " + "; ".join(problems))


def check_fingerprints(step: int, manifest: dict, state) -> None:
    """FingerprintMismatchError naming the first leaf whose fingerprint differs (exact)."""
    actual = fingerprint_lib.fingerprint_tree(state)
    bad = [path for path, leaf in manifest["leaves"].items() if actual.get(path) != leaf["fingerprint"]]
    if bad:
        first = bad[0]
        expected = manifest["leaves"][first]["fingerprint"]
        raise FingerprintMismatchError(
            f"step {step}: leaf {first} fingerprint {actual.get(first)} != saved {expected} "
            f"({len(bad)} leaf(s) differ: {', '.join(bad)})", path=first, expected=expected, actual=actual.get(first))
