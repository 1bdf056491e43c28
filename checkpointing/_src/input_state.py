"""A stateful input iterator, saved in the same Orbax step as the state: one JSON state per process.

For a pipeline whose position is not a function of the step (a filter, packing, an iterator of the
user's own): `Checkpointer(..., data_iterator=it)` adds the item

    <workdir>/checkpoints/<step>/input_state/process_<i>-of-<n>.json

written by Grain's own Orbax handler (`grain.checkpoint.CheckpointSave`: `it.get_state()` is taken
inside `save()`, before the loop advances the iterator again) and committed with the step. The
state is a process's own position, so a restore needs the process count that saved it: another count
is refused by name (InputStateError) before anything is read or written.
"""

import json
import re

from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CorruptCheckpointError, InputStateError, one_line_cause

INPUT_ITEM = "input_state"
_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def check_iterator(iterator) -> None:
    """A Grain DatasetIterator or DataLoaderIterator: what Grain's handler saves and restores."""
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        raise ValueError(f"data_iterator must be a Grain iterator (get_state/set_state), got {type(iterator).__name__}")


def save_items(iterator) -> dict:
    """The Composite item that saves `iterator`'s state ({} without one)."""
    if iterator is None:
        return {}
    import grain.checkpoint

    return {INPUT_ITEM: grain.checkpoint.CheckpointSave(iterator)}


def restore(manager, step: int, iterator, where) -> None:
    """Sets `iterator` to the position this process saved at `step` (Grain's handler reads its file)."""
    import grain.checkpoint
    import orbax.checkpoint as ocp

    try:
        manager.restore(step, args=ocp.args.Composite(**{INPUT_ITEM: grain.checkpoint.CheckpointRestore(iterator)}))
    except Exception as err:  # Grain's handler raises ValueError for a missing file, JSON errors as they are
        raise CorruptCheckpointError(f"step {step}: restoring its input iterator state from {where} failed: "
                                     f"{one_line_cause(err)}") from err


def saved_process_counts(workdir: str, step: int) -> dict[int, set[int]]:
    """{process count: process indices} of the state files `step` holds ({}: saved without an iterator)."""
    folder = workdir_lib.step_dir(workdir, step) / INPUT_ITEM
    found: dict[int, set[int]] = {}
    if folder.exists():
        for path in folder.iterdir():
            match = _STATE_FILE.fullmatch(path.name)
            if match:
                found.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    return found


def read_input_states(workdir: str, step: int) -> list[dict] | None:
    """Every process's saved iterator state of `step`, by process index; None if saved without one.
    A state file missing for some process, or not JSON, is CorruptCheckpointError naming it."""
    counts = saved_process_counts(workdir, step)
    if not counts:
        return None
    if len(counts) != 1 or counts[next(iter(counts))] != set(range(next(iter(counts)))):
        raise CorruptCheckpointError(f"step {step}: its input iterator states are incomplete "
                                     f"({_describe(counts)} in {workdir_lib.step_dir(workdir, step) / INPUT_ITEM})")
    count = next(iter(counts))
    folder = workdir_lib.step_dir(workdir, step) / INPUT_ITEM
    states = []
    for index in range(count):
        path = folder / f"process_{index}-of-{count}.json"
        try:
            states.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise CorruptCheckpointError(f"step {step}: cannot read its input iterator state {path} ({err})") from None
    return states


def check_restorable(workdir: str, step: int, *, process_count: int, has_iterator: bool) -> None:
    """InputStateError unless this run (its process count, with or without an iterator) can restore
    `step`'s input position exactly; reads only the step's directory listing."""
    counts = saved_process_counts(workdir, step)
    if has_iterator and not counts:
        raise InputStateError(f"step {step} holds no input iterator state (it was saved without data_iterator): "
                              "resume it without one, or start this pipeline in a new workdir")
    if counts and not has_iterator:
        raise InputStateError(f"step {step} holds the input iterator state of {_describe(counts)}: pass "
                              "data_iterator= to restore it (without it the input would restart at its beginning)")
    if counts and set(counts) != {process_count}:
        saved = f"a {sorted(counts)[0]}-process run" if len(counts) == 1 else _describe(counts)
        raise InputStateError(f"step {step}: its input iterator state was saved by {saved}, this run has "
                              f"{process_count} process(es); an iterator's state is one process's position and cannot "
                              "be split or merged: resume on the saved process count, or use a pipeline whose "
                              "position is the step")


def _describe(counts: dict[int, set[int]]) -> str:
    return "; ".join(f"processes {sorted(indices)} of {count}" for count, indices in sorted(counts.items()))
