"""The local tier: each process saves the shards it holds to its own fast storage (RAM disk, local SSD).

It is the same CheckpointService (a manifest with fingerprints, an atomic commit, an async save,
every restore check) pointed at one process's directory (workdir.expand_local_dir), with the
per-process writing of Orbax's own p2p LocalCheckpointManager
(orbax/checkpoint/experimental/emergency/p2p/local.py, pinned 0.12.8):
  - ArrayHandler(primary_host=None, replica_id=None): every process writes every shard it holds,
    replicas included, so one process's copy is enough to restore its part of the same layout.
  - every process writes the manifest into its own directory, and creates, commits, retains and
    cleans up (killed '<step>.orbax-checkpoint-tmp-*' saves, at start-up) its own directory.
Two differences, both so that no process ever waits for another inside Orbax:
  - Each process is a group of its own (MultiprocessingOptions(primary_host=<this process>,
    active_processes={this process})), where p2p uses primary_host=None over all processes. With
    that, Orbax's restore ends in a barrier across processes (jax's sync_global_devices), which a
    process whose own copy failed to read never reaches: its peers' next collective then pairs
    with the wrong one (seen: garbage values, then a hang). Here every cross-process step is ours,
    taken by every process in the same order whatever failed (on_every_process).
  - Directories are created in save() (a few mkdirs on a local disk), not in the background: that
    signals completion through keys in the coordination service that every process would share
    (p2p separates them with enable_per_process_directory_creation, which appends the process
    index to a process-global prefix that the persistent tier's manager would then use too).

A local step counts only if EVERY process has it committed (complete_local_steps): losing one
host's copy loses the step, never part of it, and the restore falls back to an older local step or
to the persistent tier. Orbax's p2p manager is not used: it also owns the persistent tier (ours
carries manifests, verdicts and the lease), its peer sidecar listens unauthenticated on 0.0.0.0,
and it saves only `state`.
"""

import hashlib
import json
from typing import Callable, Protocol

import jax
import orbax.checkpoint as ocp

from runtime import collective
from checkpointing._src import durable
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import orbax_hooks
from checkpointing._src import workdir as workdir_lib
from checkpointing.config import format_mesh
from checkpointing.errors import (CheckpointError, ConfigMismatchError, CorruptCheckpointError,
                                  FingerprintMismatchError, ManifestError, NoSuchCheckpointError, TreeMismatchError)

class LocalSteps(Protocol):
    """What this module reads of a tier's CheckpointService (service.py opens this host's local one)."""

    def committed_steps(self) -> list[int]: ...

    def read_manifest(self, step: int) -> dict: ...


class LocalLayoutMismatchError(CheckpointError):
    """A local step was written by another host layout (mesh, process count or index, or shards held).

    Not a BadCheckpointRequest (exit 2): nobody asked for that step by mistake. Restarting on
    another layout is normal, and the caller falls back to the persistent tier.
    """


def _this_process_alone() -> ocp.options.MultiprocessingOptions:
    me = jax.process_index()  # called after the distributed runtime has started
    # The prefix keeps any barrier key apart from the persistent tier's (a group of one takes none).
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}, barrier_sync_key_prefix="local")


def manager_options(directory: str, read_only: bool) -> dict:
    """The CheckpointManagerOptions fields of a per-process manager (see the module's docstring).

    Creates its checkpoints directory itself: Orbax refuses create=True with active_processes.
    """
    if not read_only:
        durable.make_dirs(workdir_lib.checkpoints_dir(directory))
    return dict(multiprocessing_options=_this_process_alone(), create=False,
                async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))


def item_handlers() -> dict:
    """The state written shard by shard by every process; the manifest written by every process."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    alone = _this_process_alone()
    return {
        workdir_lib.STATE_ITEM: ocp.PyTreeCheckpointHandler(
            use_ocdbt=True, use_zarr3=True, multiprocessing_options=alone, type_handler_registry=registry),
        workdir_lib.MANIFEST_ITEM: orbax_hooks.ManifestHandler(multiprocessing_options=alone),
    }


def save_args(state) -> ocp.args.CheckpointArgs:
    return ocp.args.PyTreeSave(state)


def restore_args(abstract_state) -> ocp.args.CheckpointArgs:
    """Every leaf read onto the sharding of the target (as p2p's _prepare_state_restore_args)."""
    shardings = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding), abstract_state)
    return ocp.args.PyTreeRestore(item=abstract_state, restore_args=shardings)


def manifest_fields(state) -> dict:
    """What a local manifest adds (with the mesh and process count every manifest records)."""
    return {"tier": manifest_lib.LOCAL, "process_index": jax.process_index(), "local_shards": shards_digest(state)}


def shards_digest(tree) -> str:
    """sha256 of the index ranges of the shards this process holds, per leaf: equal iff it holds the same.

    The mesh and the process index alone do not say it: a changed PartitionSpec moves shards too.
    """
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        indices = leaf.sharding.addressable_devices_indices_map(tuple(leaf.shape)).values()
        ranges = {tuple(s.indices(size)[:2] for s, size in zip(index, leaf.shape)) for index in indices}
        rows.append([jax.tree_util.keystr(path), sorted(ranges)])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _mesh_of(tree) -> dict[str, int]:
    mesh = getattr(jax.tree.leaves(tree)[0].sharding, "mesh", None)
    return {} if mesh is None else dict(mesh.shape)


def _describe(mesh: dict, process_index, process_count) -> str:
    return f"process {process_index} of {process_count} on mesh {format_mesh(mesh) or 'none'}"


def check_layout(step: int, manifest: dict, abstract_state) -> None:
    """LocalLayoutMismatchError naming both layouts unless this process holds the shards it saved."""
    if manifest_lib.tier(manifest) != manifest_lib.LOCAL:
        raise LocalLayoutMismatchError(f"step {step} is not a local step (its manifest names no local layout)")
    saved = _describe(manifest["mesh"], manifest.get("process_index"), manifest["process_count"])
    current = _describe(_mesh_of(abstract_state), jax.process_index(), jax.process_count())
    if saved != current:  # the mesh's axis order included
        raise LocalLayoutMismatchError(f"local step {step} was saved by {saved}; this is {current}")
    if manifest.get("local_shards") != shards_digest(abstract_state):
        raise LocalLayoutMismatchError(
            f"local step {step} was saved by {saved} holding other shards than this program places there "
            "(its partitioning changed)")


def other_layout(service: LocalSteps, abstract_state) -> str | None:
    """Why the local tier cannot serve this layout (collective), or None: each process checks the
    layout of its own newest local step, and the first mismatch any process finds is everyone's answer.

    A restart with more processes finds no step complete everywhere (the new hosts have none); this
    says why, in one line, instead of silently using the persistent tier.
    """
    mine, problem = service.committed_steps(), ""
    if mine:
        try:
            check_layout(mine[-1], service.read_manifest(mine[-1]), abstract_state)
        except (LocalLayoutMismatchError, ManifestError, CorruptCheckpointError) as err:
            problem = str(err)
    flags = collective.gather_ints(bool(problem))
    first = next((i for i, flag in enumerate(flags) if flag), None)
    if first is None:
        return None
    return problem or f"process {first} holds local steps saved by another layout"


def _every_process_steps(service: LocalSteps) -> list[set[int]]:
    """Each process's committed local steps (collective: every process calls it)."""
    return [set(steps) for steps in collective.gather_lists(service.committed_steps())]


def complete_local_steps(service: LocalSteps) -> list[int]:
    """Steps EVERY process has committed in its own local directory, ascending; the same on all processes.

    Collective: every process calls it. A single process returns its own listing.
    """
    return sorted(set.intersection(*_every_process_steps(service)))


def any_local_steps(service: LocalSteps) -> list[int]:
    """Steps ANY process has committed locally, ascending; the same on all processes (collective).

    What a resume sets aside above its start step, so no process's old copy collides with a new save.
    """
    return sorted(set.union(*_every_process_steps(service)))


# What a local restore may raise on one process alone, in the order a shared outcome is chosen;
# anything else is reported as CorruptCheckpointError. A fingerprint too: a replicated leaf's
# fingerprint is computed from each process's own copy of it.
_SHARED_OUTCOMES = (LocalLayoutMismatchError, NoSuchCheckpointError, ConfigMismatchError, TreeMismatchError,
                    ManifestError, CorruptCheckpointError, FingerprintMismatchError)


def on_every_process(step: int, part: Callable):
    """part(), collectively: if it fails on any process, every process raises (see raise_if_any_failed).

    A process that went on alone would wait forever in the next collective (Orbax's barriers, the
    fingerprints' reduction) for peers that have left.
    """
    result, failure = None, None
    try:
        result = part()
    except CheckpointError as err:
        failure = err
    raise_if_any_failed(step, failure)
    return result


def raise_if_any_failed(step: int, failure: CheckpointError | None) -> None:
    """Collective: if any process failed, every process raises the same error class (that of the
    lowest-numbered failing process), so all take the same fallback; a failing one keeps its message."""
    if collective.process_count() == 1:
        if failure is not None:
            raise failure
        return
    own = 0 if failure is None else 1 + next(
        (i for i, kind in enumerate(_SHARED_OUTCOMES) if isinstance(failure, kind)),
        _SHARED_OUTCOMES.index(CorruptCheckpointError))
    codes = collective.gather_ints(own)
    failed = [index for index, code in enumerate(codes) if code]
    if not failed:
        return
    kind = _SHARED_OUTCOMES[codes[failed[0]] - 1]
    if isinstance(failure, kind):
        raise failure
    message = (f"local step {step}: process(es) {', '.join(map(str, failed))} could not use their copy "
               f"({kind.__name__}" + (f"; here: {failure})" if failure else ")"))
    if kind is FingerprintMismatchError:  # which leaf and values: only the failing process knows
        raise FingerprintMismatchError(message, path="", expected=0, actual=None) from failure
    raise kind(message) from failure
