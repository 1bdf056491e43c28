"""The global batch of a step from record files: each process reads only the rows its devices hold.

`RecordBatches(dataset, batch_size, sharding)` is a batch function, step -> {"tokens": jax.Array},
in the place of trainer/data.py's synthetic one. The array's rows are the dataset's rows of that
step (trainer/input/order.py), laid out by `sharding` (batch axis over 'data'): the process works
out which row ranges its addressable devices hold, reads only those records, and builds the
global array with jax.make_array_from_callback. No host holds or gathers the global batch, and
another host count or mesh reads the same global batch.

Reading runs ahead of the step: the rows of the next steps are read by Grain's read threads
(`MapDataset.map(...).to_iter_dataset(ReadOptions)`, an ordered thread-pool prefetch) while the
step runs. Consecutive steps come from that iterator; a call for any other step (a restart, a
rollback) starts a new iterator at that step: the rows depend on the step alone.
"""

import sys
import threading
import time

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from trainer.input.errors import DataError
from trainer.input.records import RecordDataset, open_records

Range = tuple[int, int]


def local_row_ranges(sharding: NamedSharding, global_shape: tuple[int, ...]) -> list[Range]:
    """The distinct [start, stop) row ranges of the batch held by this process's devices, sorted."""
    ranges = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        ranges.add(_range(index[0] if index else slice(None), global_shape[0]))
    return sorted(ranges)


def _range(rows: slice, length: int) -> Range:
    start, stop, step = rows.indices(length)
    if step != 1:
        raise ValueError(f"a batch shard with stride {step}: only contiguous row ranges are supported")
    return start, stop


class RecordBatches:
    """step -> {"tokens": global int32 array (batch_size, tokens per record)} sharded by `sharding`."""

    def __init__(self, dataset: RecordDataset, batch_size: int, sharding: NamedSharding, *,
                 prefetch_steps: int = 2, read_threads: int = 2):
        self.dataset, self.batch_size, self.sharding = dataset, int(batch_size), sharding
        self.global_shape = (self.batch_size, *dataset.record_shape)
        self.ranges = local_row_ranges(sharding, self.global_shape)
        self.read_options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch_steps)
        self.steps_read = 0  # steps whose rows this process has read (the read-ahead included)
        self.wait_secs = 0.0  # total time __call__ waited for rows that were not read yet
        self.last_wait_secs = 0.0
        self._iterator, self._next_step = None, None
        self._idle, self._in_flight = threading.Condition(), 0

    @property
    def rows_per_step(self) -> int:
        """Records this process reads per step (its devices' distinct rows)."""
        return sum(stop - start for start, stop in self.ranges)

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch's shape and dtype, without reading a record."""
        return {"tokens": jax.ShapeDtypeStruct(self.global_shape, np.int32, sharding=self.sharding)}

    def host_rows(self, step: int) -> dict[Range, np.ndarray]:
        """This process's rows of `step`, read from the files: {(start, stop): records}."""
        with self._idle:
            self._in_flight += 1
        try:
            indices = self.dataset.rows_of_step(step, self.batch_size)
            rows = {(start, stop): self.dataset.read(indices[start:stop]) for start, stop in self.ranges}
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()
        with self._idle:
            self.steps_read += 1
        return rows

    def _start(self, step: int) -> None:
        steps = grain.MapDataset.range(step, sys.maxsize).map(self.host_rows)
        self._iterator = iter(steps.to_iter_dataset(self.read_options))
        self._next_step = step

    def __call__(self, step) -> dict[str, jax.Array]:
        step = int(step)
        if step != self._next_step:
            self._start(step)
        began = time.perf_counter()
        try:
            rows = next(self._iterator)
        except BaseException:
            self.close()  # the next call starts afresh at its step
            raise
        self.last_wait_secs = time.perf_counter() - began
        self.wait_secs += self.last_wait_secs
        self._next_step = step + 1
        length = self.global_shape[0]

        def shard(index):
            return rows[_range(index[0] if index else slice(None), length)]

        return {"tokens": jax.make_array_from_callback(self.global_shape, self.sharding, shard)}

    def close(self, timeout_secs: float = 60.0) -> None:
        """Stops the read-ahead and waits (bounded) for the reads already under way to end."""
        iterator, self._iterator, self._next_step = self._iterator, None, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()  # Grain cancels the queued reads; a running one finishes
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_secs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def record_batches(data: str, seed: int, batch_size: int, sharding: NamedSharding, *, seq_len: int | None = None,
                   vocab_size: int | None = None, check_data: str = "stat", **options) -> RecordBatches:
    """The batch function of `--data=records:<glob>`, checked against the model's flags at start-up:
    each record must hold seq_len + 1 tokens, and prepare's vocabulary must fit in vocab_size.
    `check_data` is how the files' content digests are taken (trainer/input/digests.py)."""
    dataset = open_records(data, seed, check_data)
    if seq_len is not None and dataset.record_shape != (seq_len + 1,):
        raise DataError(f"--seq_len={seq_len}: the records of --data={data} hold {dataset.record_shape[0]} tokens, "
                        f"examples of --seq_len={dataset.record_shape[0] - 1}")
    known = (dataset.metadata() or {}).get("vocab_size")
    if vocab_size is not None and known is not None and known > vocab_size:
        raise DataError(f"--vocab_size={vocab_size}: the records of --data={data} use a vocabulary of {known}")
    return RecordBatches(dataset, batch_size, sharding, **options)
