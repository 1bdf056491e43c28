"""The order of the records: the rows of step s are a pure function of (seed, s, the dataset).

Epoch e is a permutation of all records (every file's, by global index: file order, then position)
keyed by (seed, e): Grain's index shuffle (`MapDataset.shuffle`, a 4-round Feistel permutation
over [0, n), reseeded each epoch by `repeat`). The epochs are concatenated into one endless
sequence of global rows and step s reads rows s*B .. s*B+B-1 of it, so an epoch boundary is exact
(no record is dropped or repeated across it; a batch may straddle two epochs) and a restart at
step s needs nothing but s. Nothing is materialised: each row is computed in O(1).
"""

import hashlib

import grain
import numpy as np


def shuffle_seed(seed: int) -> int:
    """The 32-bit seed of epoch 0. Grain seeds epoch e with (seed + e) mod 2**32, so the run's seed
    is hashed first: runs with seeds 0 and 1 must not see the same orders one epoch apart."""
    digest = hashlib.sha256(f"trainer.input.order:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class Order:
    """Global row -> record index, for one dataset size and one seed."""

    def __init__(self, num_records: int, seed: int):
        if num_records < 1:
            raise ValueError(f"an order needs at least one record, got {num_records}")
        self.num_records, self.seed = int(num_records), int(seed)
        self._rows = grain.MapDataset.range(self.num_records).shuffle(seed=shuffle_seed(seed)).repeat()

    def records(self, start: int, stop: int) -> np.ndarray:
        """Record indices of global rows start .. stop-1 (int64)."""
        return np.fromiter((self._rows[row] for row in range(start, stop)), dtype=np.int64, count=stop - start)

    def rows_of_step(self, step: int, batch_size: int) -> np.ndarray:
        """Record indices of the global batch of `step`: rows step*B .. step*B+B-1."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"step must be >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
        return self.records(step * batch_size, (step + 1) * batch_size)

    def epoch_of_row(self, row: int) -> int:
        return row // self.num_records


def rows_of_step(step: int, batch_size: int, *, num_records: int, seed: int) -> np.ndarray:
    """The record indices of the global batch of `step` over `num_records` records shuffled by `seed`."""
    return Order(num_records, seed).rows_of_step(step, batch_size)
