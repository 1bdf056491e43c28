"""A partial restore: one named subtree of a committed step (its params, say), for evaluation,
fine-tuning and `--init_from`, with the same guarantees as a whole restore.

The subtree's paths, shapes and dtypes are checked against the manifest before any array is read,
and every restored leaf's fingerprint against the one taken at save time; the rest of the step is
never read. Orbax's PyTree handler reads only the leaves the target names (`partial_restore`).
"""

import jax
import orbax.checkpoint as ocp

from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import reads
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import FingerprintMismatchError, NoSuchCheckpointError, TreeMismatchError


def saved_paths(manifest: dict, name: str) -> dict[str, str]:
    """{path inside the subtree: path in the step} for the subtree `name` (an attribute `.name` of a
    dataclass state such as flax's TrainState, or a dict key `['name']`)."""
    found = {}
    for prefix in (f".{name}", f"[{name!r}]"):
        found.update({path[len(prefix):]: path for path in manifest["leaves"] if path.startswith(prefix)
                      and path[len(prefix):len(prefix) + 1] in ("[", ".")})
    return found


def restore_subtree(directory: str, step: int, name: str, abstract_subtree) -> tuple[object, dict]:
    """(the subtree `name` of committed `step` on the shardings of `abstract_subtree`, its manifest)."""
    if step not in workdir_lib.committed_steps(directory):
        raise NoSuchCheckpointError(f"step {step} is not a committed checkpoint in {directory} "
                                    f"(committed: {workdir_lib.committed_steps(directory) or 'none'})")
    manifest = workdir_lib.read_manifest(directory, step)
    saved = saved_paths(manifest, name)
    if not saved:
        raise TreeMismatchError(f"step {step} of {directory} has no subtree {name!r} "
                                f"(its leaves start {sorted(manifest['leaves'])[:3]})")
    wanted = manifest_lib.leaf_table(abstract_subtree)
    problems = [f"{name}{p} missing from the checkpoint" for p in sorted(set(wanted) - set(saved))]
    problems += [f"{name}{p} not in the target" for p in sorted(set(saved) - set(wanted))]
    for path in sorted(set(saved) & set(wanted)):
        leaf = manifest["leaves"][saved[path]]
        if (leaf["shape"], leaf["dtype"]) != (wanted[path]["shape"], wanted[path]["dtype"]):
            problems.append(f"{saved[path]} is {leaf['dtype']}{leaf['shape']} in the checkpoint vs "
                            f"{wanted[path]['dtype']}{wanted[path]['shape']}")
    if problems:
        raise TreeMismatchError(f"step {step} of {directory}: subtree {name!r} does not match: " + "; ".join(problems))
    key = name  # Orbax stores a dataclass's fields and a dict's keys alike, by name
    target = {key: abstract_subtree}
    restore_args = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding), target)
    manager = ocp.CheckpointManager(workdir_lib.checkpoints_dir(directory), item_names=(workdir_lib.STATE_ITEM,),
                                    options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    args = ocp.args.Composite(**{workdir_lib.STATE_ITEM: ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)})
    try:
        restored = reads.read_retrying(lambda: manager.restore(step, args=args), f"step {step}: reading subtree "
                                       f"{name!r} from {workdir_lib.step_dir(directory, step)}")
    finally:
        manager.close()
    subtree = restored[workdir_lib.STATE_ITEM][key]
    actual = fingerprint_lib.fingerprint_tree(subtree)
    for path, full in saved.items():
        expected = manifest["leaves"][full]["fingerprint"]
        if actual.get(path) != expected:
            raise FingerprintMismatchError(f"step {step}: leaf {full} fingerprint {actual.get(path)} != saved "
                                           f"{expected}", path=full, expected=expected, actual=actual.get(path))
    return subtree, manifest
