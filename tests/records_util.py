"""Real ArrayRecord files for the input tests, written through array_record's own writer."""

import hashlib
import json
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


def read_all(path: str) -> list[bytes]:
    reader = array_record_module.ArrayRecordReader(path)
    try:
        return reader.read(list(range(reader.num_records())))
    finally:
        reader.close()


def write_all(path: str, rows: list[bytes]) -> None:
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    try:
        for row in rows:
            writer.write(row)
    finally:
        writer.close()


def swap_two_tokens(path: str) -> None:
    """Rewrites `path` with two neighbouring, different tokens of its middle record swapped: the same
    size, record count and first and last records (what identified a file before content digests)."""
    before, rows = os.stat(path), read_all(path)
    middle = len(rows) // 2
    tokens = np.frombuffer(rows[middle], "<i4").copy()
    i = int(np.flatnonzero(tokens[:-1] != tokens[1:])[0])
    tokens[[i, i + 1]] = tokens[[i + 1, i]]
    write_all(path, [*rows[:middle], tokens.tobytes(), *rows[middle + 1:]])
    after, swapped = os.stat(path), read_all(path)
    assert (after.st_size, len(swapped), swapped[0], swapped[-1]) == (before.st_size, len(rows), rows[0], rows[-1])
    assert swapped[middle] != rows[middle] and after.st_mtime_ns != before.st_mtime_ns, "a real write"


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def legacy_identity(dataset) -> dict:
    """What RecordDataset.identity recorded before content digests (name, size, records, edges)."""
    files = [{key: f[key] for key in ("name", "size", "records", "edges")} for f in dataset.files]
    digest = hashlib.sha256(json.dumps([files, dataset.record_bytes], sort_keys=True).encode()).hexdigest()
    return {"files": files, "record_bytes": dataset.record_bytes, "num_records": dataset.num_records,
            "digest": digest, "seed": dataset.seed}
