"""Real ArrayRecord files for the input tests, written through array_record's own writer."""

import os

import numpy as np
from array_record.python import array_record_module

TOKENS = 6  # int32 tokens per record


def record(index: int) -> np.ndarray:
    """Record `index` of a written dataset: its global index, then a pattern of it."""
    return (index * 1000 + np.arange(TOKENS)).astype(np.int32)


def write_files(folder: str, counts: list[int], prefix: str = "train") -> str:
    """One file per count, records numbered globally in file order; returns the glob."""
    os.makedirs(folder, exist_ok=True)
    first = 0
    for i, count in enumerate(counts):
        write_file(os.path.join(folder, f"{prefix}-{i:05d}.array_record"), range(first, first + count))
        first += count
    return os.path.join(folder, f"{prefix}-*.array_record")


def write_file(path: str, indices) -> None:
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    try:
        for index in indices:
            writer.write(record(index).tobytes())
    finally:
        writer.close()
