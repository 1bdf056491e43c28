"""The Orbax pieces the service plugs in: a manifest written inside the background save, a
retention policy that spares protected steps, a durable commit on local disks, a manager that
asks the caller's preemption decision. Importing it teaches Orbax s3:// (orbax_s3.py).

Kept apart from the service because they lean on Orbax's extension points (one of them private:
tests/test_service_api.py pins it), so an Orbax upgrade is read here first.
"""

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Callable, Iterable, Sequence

import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers
from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
from orbax.checkpoint._src.path import async_path, atomicity

from checkpointing._src import durable
from checkpointing._src import orbax_s3  # noqa: F401  (s3:// as gs://, installed on import)
from checkpointing._src import marks as marks_lib
from checkpointing._src import workdir as workdir_lib


def dispatch_fingerprints(into: concurrent.futures.Future, state) -> None:
    """Dispatches the state's fingerprints into `into`, which the manifest waits on, or their error."""
    try:
        into.set_result(marks_lib.Fingerprints(state))
    except Exception as err:
        into.set_exception(err)  # the manifest fails with it in the background: the step never commits
        raise


class ManifestHandler(ocp.handlers.JsonCheckpointHandler):
    """Orbax's JSON handler, but the manifest is built in the background write, not in save().

    The fingerprints are dispatched to the device in save() and only read back here, while
    the arrays are being written, so the step never waits for them. The manifest is still part of
    the same step, so the step commits only once it is written.
    """

    def __init__(self, filename: str | None = None, **kwargs):
        super().__init__(filename or workdir_lib.MANIFEST_FILE, **kwargs)

    # Private in Orbax 0.12 (tests/test_service_api.py pins its signature): the one hook that runs
    # inside the background write, where the fingerprints may be awaited without blocking save().
    async def _save_fn(self, x, directory):
        if callable(x):
            x = await asyncio.to_thread(x)  # waits for the fingerprints off the event loop
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(ManifestHandler, for_save=True)
@dataclasses.dataclass
class ManifestSave(ocp.args.CheckpointArgs):
    item: Callable[[], dict]  # builds the manifest; called once, in the background


@ocp.args.register_with_handler(ManifestHandler, for_restore=True)
@dataclasses.dataclass
class ManifestRestore(ocp.args.CheckpointArgs):
    """Registered because Orbax wants a restore pair; manifests are read with read_manifest()."""


class ProtectedSteps(checkpoint_managers.PreservationPolicy):
    """Preserves the steps a callback names (e.g. the newest verified step) at deletion time.

    The callback gets the steps Orbax holds (its own list, kept as it saves and deletes): asked inside
    every save() while the caller blocks, it must not list the directory."""

    def __init__(self, protected: Callable[[list[int]], Iterable[int]]):
        self._protected = protected

    def should_preserve(self, checkpoints, *, context) -> Sequence[bool]:
        keep = set(self._protected([info.step for info in checkpoints]))
        return [info.step in keep for info in checkpoints]


class DurableRename(atomicity.AtomicRenameTemporaryPath):
    """Orbax's commit on a local disk (rename `<step>.orbax-checkpoint-tmp` to `<step>`), made durable.

    TensorStore fsyncs the array chunks, but Orbax's own files (`_CHECKPOINT_METADATA`,
    `state/_METADATA`, `array_metadatas/process_*`, the manifest) and the rename never are. So, in
    the order of checkpointing/_src/durable.py: every file of the tmp directory is fsynced once the last
    one is written, then the rename, then `checkpoints/`. Orbax logs "Finished saving" and the
    manager counts the step only after this returns, so no commit is reported before it is durable.

    Its body is Orbax 0.12's `AtomicRenameTemporaryPath.finalize` with the two fsyncs added
    (tests/test_durability.py pins that body).
    """

    async def finalize(self) -> None:
        if self._snapshot is not None:  # the service never asks for snapshots
            raise NotImplementedError("DurableRename does not support snapshots")
        tmp, final = self.get(), self.get_final()
        logging.vlog(1, "Renaming %s to %s", tmp, final)  # Orbax's line, three per save: at --v=1
        store = self._checkpoint_metadata_store
        if store:  # Orbax records the commit time in _CHECKPOINT_METADATA before the rename
            await asyncio.to_thread(store.wait_until_finished)
            await asyncio.to_thread(store.update, file_path=checkpoint_metadata.step_metadata_file_path(tmp),
                                    commit_timestamp_nsecs=time.time_ns())
            await asyncio.to_thread(store.wait_until_finished)
        await async_path.write_text(tmp / atomicity.COMMIT_SUCCESS_FILE, f"Checkpoint commit was successful to {final}")
        await asyncio.to_thread(durable.sync_tree, tmp)
        await async_path.rename(tmp, final)
        await asyncio.to_thread(durable.sync_dir, final.parent)


class Manager(ocp.CheckpointManager):
    """Orbax's manager, answering its own preemption queries from the caller's one decision, with a
    durable commit (DurableRename) on local disks, and a background write's failure known at once.

    In a pod, a write that fails on one process only (its disk full or failing) leaves Orbax's finalize
    thread there, and the others' background threads, waiting at a barrier the failed write never reaches,
    for up to Orbax's 20-minute timeout: every process hung, and the one line that could have named the
    disk was the watchdog's. So the failure is recorded as soon as the finalize thread sees it
    (`background_failure`), before that barrier, and `finished_or_failed()` waits for either.
    """

    def __init__(self, directory, *args, preemption_decision: Callable[[int], bool],
                 options: ocp.CheckpointManagerOptions | None = None, **kwargs):
        self._preemption_decision = preemption_decision
        self.background_failure: BaseException | None = None  # the newest background write's error
        self._repeat_pending = False  # that error was raised to the caller; Orbax will raise it once more
        options = options or ocp.CheckpointManagerOptions()
        if durable.is_local(directory) and options.temporary_path_class is None:
            options = dataclasses.replace(options, temporary_path_class=DurableRename)
        super().__init__(directory, *args, options=options, **kwargs)

    def reached_preemption(self, step: int) -> bool:
        return self._preemption_decision(step)

    # Private in Orbax 0.12 (tests/test_service_api.py pins both): the finalize thread's wait for the
    # background write, which re-raises its error before the thread's cross-process barrier.
    def _wait_for_checkpointers(self):
        try:
            super()._wait_for_checkpointers()
        except BaseException as err:
            self.background_failure = err
            raise

    def finalizing(self) -> bool:
        """Whether Orbax's finalize thread (the background write and its cross-process barrier) is running."""
        return self._finalize_thread.map(lambda thread: thread is not None and thread.is_alive())

    def finished_or_failed(self, poll_secs: float = 0.02) -> bool:
        """Waits until no save is finalizing, or its background write failed (True: it failed; the finalize
        thread may still be waiting for the other processes, and joining it would wait with it)."""
        while (thread := self._finalize_thread.get()) is not None and thread.is_alive():
            if self.background_failure is not None:
                return True
            thread.join(poll_secs)  # returns as soon as the thread ends
        return self.background_failure is not None

    def joined_error(self) -> BaseException | None:
        """The error of a finished save that Orbax's finalize thread consumed (raised once, and only logged by
        Orbax): joining the thread raises it again, so the caller's line can name the cause. None if none."""
        try:
            self.wait_until_finished()
        except Exception as err:  # noqa: BLE001  Orbax's or TensorStore's, as they raised it
            return err
        return None

    def reported(self, error: BaseException | None) -> None:
        """The caller raised `error`; if it is the recorded one, Orbax's finalize thread still holds it."""
        self._repeat_pending = error is not None and error is self.background_failure

    def drop_repeated_failure(self) -> None:
        """Orbax re-raises a failed write's error when its finalize thread is next waited for (the next save,
        or close), already raised by then: waits for that thread (at once, unless other processes hold its
        barrier, where the process exits instead) and drops the repeat."""
        if self._repeat_pending:
            self._repeat_pending = False
            try:
                self.wait_until_finished()
            except Exception:  # noqa: BLE001  the error the caller was given before
                pass
