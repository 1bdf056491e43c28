"""Multi-host agreement, in one place: process 0 decides and tells everyone, or every process tells all.

Every process of a pod must take the same branch at the same step: a host that saves, restores or
replays alone waits forever in the next collective. Each helper is a collective itself, so every
process calls it at the same point, and on a single process it returns its input without one.
"""

from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def process_count() -> int:
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Process 0: the one that decides, logs metrics and writes a workdir's shared files."""
    import jax

    return jax.process_index() == 0


def broadcast_ints(values: Sequence[int]) -> list[int]:
    """Process 0's `values` on every process (all must pass the same length)."""
    values = [int(v) for v in values]
    if process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64)))]


def broadcast_int(value: int) -> int:
    return broadcast_ints([value])[0]


def broadcast_rows(rows: Sequence[Sequence[int]], width: int) -> list[tuple[int, ...]]:
    """Process 0's list of int rows (any length; other processes pass anything) on every process."""
    mine = np.asarray(rows, np.int64).reshape(-1, width) if len(rows) else np.zeros((0, width), np.int64)
    if process_count() == 1:
        return [tuple(int(x) for x in row) for row in mine]
    count = broadcast_int(len(mine))
    padded = np.zeros((max(count, 1), width), np.int64)
    padded[:min(len(mine), count)] = mine[:count]
    from jax.experimental import multihost_utils

    shared = np.asarray(multihost_utils.broadcast_one_to_all(padded))[:count]
    return [tuple(int(x) for x in row) for row in shared]


def decided_by_primary(decide: Callable[[], bool]) -> bool:
    """Process 0 calls `decide` (its clock, its listing) and every process gets its answer."""
    return bool(broadcast_int(int(decide()) if is_primary() else 0))


def gather_ints(value: int) -> list[int]:
    """Every process's `value`, in process order, on every process."""
    if process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).reshape(-1)]


def gather_lists(values: Sequence[int]) -> list[list[int]]:
    """Every process's list of ints (lengths may differ), in process order, on every process."""
    if process_count() == 1:
        return [[int(v) for v in values]]
    from jax.experimental import multihost_utils

    longest = max(gather_ints(len(values)))
    row = np.full((max(longest, 1),), -1, np.int64)
    row[:len(values)] = values
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(process_count(), -1)
    return [[int(v) for v in r if v != -1] for r in rows]


def first_failure(code: int) -> int:
    """The first nonzero of every process's `code` (0 when all succeeded), on every process:
    a part that can fail on one host (a local disk) is taken, or left, by all of them together."""
    return next((c for c in gather_ints(code) if c), 0)


def barrier(name: str) -> None:
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
