"""The Orbax pieces the service plugs in: a manifest written inside the background save, a
retention policy that spares protected steps, and a manager that asks the caller's preemption decision.

Kept apart from the service because they lean on Orbax's extension points (one of them private:
tests/test_service_api.py pins it), so an Orbax upgrade is read here first.
"""

import asyncio
import concurrent.futures
import dataclasses
from typing import Callable, Iterable, Sequence

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from checkpointing import fingerprint as fingerprint_lib
from checkpointing import workdir as workdir_lib


def dispatch_fingerprints(into: concurrent.futures.Future, state) -> None:
    """Dispatches the state's fingerprints into `into`, which the manifest waits on, or their error."""
    try:
        into.set_result(fingerprint_lib.tree_fingerprints(state))
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
    """Preserves the steps a callback names (e.g. the newest verified step) at deletion time."""

    def __init__(self, protected: Callable[[], Iterable[int]]):
        self._protected = protected

    def should_preserve(self, checkpoints, *, context) -> Sequence[bool]:
        keep = set(self._protected())
        return [info.step in keep for info in checkpoints]


class Manager(ocp.CheckpointManager):
    """Orbax's manager, answering its own preemption queries from the caller's one decision."""

    def __init__(self, *args, preemption_decision: Callable[[int], bool], **kwargs):
        self._preemption_decision = preemption_decision
        super().__init__(*args, **kwargs)

    def reached_preemption(self, step: int) -> bool:
        return self._preemption_decision(step)
