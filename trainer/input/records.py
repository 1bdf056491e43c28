"""A dataset of ArrayRecord files, read by global record index through Grain, and its identity.

`--data=records:<glob>` names the files (a local path: a bucket is mounted, see docs/data.md).
Files are taken in sorted order; record i of the dataset is record i - (records before its file)
of its file. Every record holds the same number of int32 tokens (trainer/prepare.py writes them).

The identity (`RecordDataset.identity`) is what a manifest records and a resume must not change:
the files by name relative to the glob's directory, their sizes and record counts, a hash of each
file's first and last records, the sha256 of each file's bytes (trainer/input/digests.py: taken
from prepare's metadata or a cache where the file's size and mtime vouch for it, else hashed), a
digest of all that, and the shuffle seed. `check_same` refuses a different one by name; an
identity recorded before content digests (no sha256) is compared without them. ArrayRecord
reports a damaged file as a RuntimeError (on open, or on the read that reaches the damage); every
one is converted here to a RecordFileError naming the file.
"""

import bisect
import glob
import hashlib
import json
import os
import threading

import grain
import numpy as np
from array_record.python import array_record_module

from trainer.input import digests as digests_lib
from trainer.input import order as order_lib
from trainer.input.errors import (ContentChangedError, DataError, DatasetChangedError, NoRecordFilesError,
                                  RecordFileError)

PREFIX = "records:"
METADATA = "metadata.json"  # written by trainer/prepare.py next to the shards
TOKEN_DTYPE = np.dtype("<i4")


def parse_flag(value: str) -> str:
    """The glob of a `records:<glob>` flag value."""
    pattern = value[len(PREFIX):] if value.startswith(PREFIX) else ""
    if not pattern:
        raise DataError(f"--data={value}: expected records:<glob>, e.g. records:/data/train-*.array_record")
    return pattern


def glob_root(pattern: str) -> str:
    """The directory of the glob's first wildcard: file names in the identity are relative to it."""
    head = pattern
    while any(ch in head for ch in "*?["):
        head = os.path.dirname(head)
    return head if head != pattern else os.path.dirname(pattern)


def _file_facts(path: str, root: str) -> dict:
    """Name, size, record count, record size and a hash of the first and last records of one file."""
    name = os.path.relpath(path, root)
    try:
        size = os.path.getsize(path)
        reader = array_record_module.ArrayRecordReader(path)
        try:
            count = reader.num_records()
            if count < 1:
                raise RecordFileError(path, "holds no records (truncated, or not an ArrayRecord file)")
            first, last = reader.read([0, count - 1])
        finally:
            reader.close()
    except FileNotFoundError:
        raise RecordFileError(path, "missing") from None
    except (RuntimeError, OSError) as err:
        raise RecordFileError(path, f"unreadable ArrayRecord file: {_first_line(err)}") from None
    if len(first) != len(last) or not first or len(first) % TOKEN_DTYPE.itemsize:
        raise RecordFileError(path, f"records of {len(first)} and {len(last)} bytes: not fixed-length int32 tokens")
    edges = hashlib.sha256(first + last).hexdigest()[:16]
    return {"name": name, "size": size, "records": count, "record_bytes": len(first), "edges": edges}


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class RecordDataset:
    """The records of a glob, read by global index (Grain's ArrayRecordDataSource), in the order of a seed."""

    def __init__(self, pattern: str, seed: int, check_data: str = digests_lib.STAT):
        self.pattern, self.seed = pattern, int(seed)
        self.paths = sorted(glob.glob(pattern))
        if not self.paths:
            raise NoRecordFilesError(pattern)
        self.root = glob_root(pattern)
        self.files = [_file_facts(path, self.root) for path in self.paths]
        sizes = {f["record_bytes"] for f in self.files}
        if len(sizes) != 1:
            odd = next(f for f in self.files if f["record_bytes"] != self.files[0]["record_bytes"])
            raise RecordFileError(os.path.join(self.root, odd["name"]),
                                  f"records of {odd['record_bytes']} bytes, the first file's are "
                                  f"{self.files[0]['record_bytes']}")
        self.record_bytes = sizes.pop()
        shas, self.digest_tally = digests_lib.content_digests(self.paths, [f["name"] for f in self.files],
                                                              self.metadata(), check_data)
        for facts, sha in zip(self.files, shas):
            facts["sha256"] = sha
        self.record_shape = (self.record_bytes // TOKEN_DTYPE.itemsize,)
        self._ends = list(np.cumsum([f["records"] for f in self.files]).tolist())
        self.num_records = self._ends[-1]
        self.order = order_lib.Order(self.num_records, self.seed)
        try:
            # "path[0:n]": Grain takes the record counts from us instead of opening every file again.
            self.source = grain.sources.ArrayRecordDataSource(
                [f"{path}[0:{f['records']}]" for path, f in zip(self.paths, self.files)])
        except (RuntimeError, OSError) as err:
            raise RecordFileError(self.pattern, f"unreadable: {_first_line(err)}") from None
        self._lock = threading.Lock()
        self.records_read = 0  # by this process: the test of "each process reads only its own rows"

    def metadata(self) -> dict | None:
        """prepare's metadata.json next to the files (vocab size, tokenizer, shard digests...), or None."""
        path = os.path.join(self.root, METADATA)
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise RecordFileError(path, f"unreadable: {_first_line(err)}") from None

    def rows_of_step(self, step: int, batch_size: int) -> np.ndarray:
        """Global record indices of the batch of `step` (see trainer/input/order.py)."""
        return self.order.rows_of_step(step, batch_size)

    def path_of(self, index: int) -> str:
        return self.paths[bisect.bisect_right(self._ends, int(index))]

    def read(self, indices) -> np.ndarray:
        """The records at these global indices as an int32 array (len(indices), *record_shape)."""
        indices = [int(i) for i in indices]
        if not indices:
            return np.zeros((0, *self.record_shape), TOKEN_DTYPE)
        try:
            records = self.source.__getitems__(indices)
        except (RuntimeError, OSError) as err:
            raise RecordFileError(self._damaged(indices), f"unreadable record: {_first_line(err)}") from None
        with self._lock:
            self.records_read += len(records)
        for index, record in zip(indices, records):
            if len(record) != self.record_bytes:
                raise RecordFileError(self.path_of(index), f"record {index} has {len(record)} bytes, not "
                                                           f"{self.record_bytes} (truncated or changed)")
        return np.frombuffer(b"".join(records), TOKEN_DTYPE).reshape(len(records), *self.record_shape)

    def _damaged(self, indices: list[int]) -> str:
        """The file a failed batched read came from: read its records one file at a time."""
        for path in dict.fromkeys(self.path_of(i) for i in indices):
            try:
                self.source.__getitems__([i for i in indices if self.path_of(i) == path])
            except (RuntimeError, OSError):
                return path
        return self.pattern

    def identity(self) -> dict:
        """What a manifest records and a resume must not change."""
        files = [{key: f[key] for key in ("name", "size", "records", "edges", "sha256")} for f in self.files]
        return {"files": files, "record_bytes": self.record_bytes, "num_records": self.num_records,
                "digest": digest_of(files, self.record_bytes), "seed": self.seed}


def digest_of(files: list[dict], record_bytes: int) -> str:
    """The identity's digest: of every file's facts (their sha256 included, where recorded) and the record size."""
    return hashlib.sha256(json.dumps([files, record_bytes], sort_keys=True).encode()).hexdigest()


def has_content(identity: dict) -> bool:
    """Whether an identity records its files' content (one written before content digests does not)."""
    return bool(identity.get("files")) and all("sha256" in f for f in identity["files"])


def open_records(value: str, seed: int, check_data: str = digests_lib.STAT) -> RecordDataset:
    """The dataset of a `records:<glob>` flag value (one-line typed errors, exit 2 at start-up)."""
    return RecordDataset(parse_flag(value), seed, check_data)


def check_same(recorded: dict, current: dict) -> None:
    """Raises DatasetChangedError naming the first field or file that differs. An identity recorded
    before content digests has no sha256: a missing field is not a change, and its digest is compared
    with the current one's taken the same way (without them)."""
    if recorded.get("seed") != current.get("seed"):
        raise DatasetChangedError("seed", recorded.get("seed"), current.get("seed"))
    before = {f["name"]: f for f in recorded.get("files", [])}
    now = {f["name"]: f for f in current.get("files", [])}
    for name in sorted(before.keys() | now.keys()):
        if name not in now:
            raise DatasetChangedError(f"file {name}", "present", "missing")
        if name not in before:
            raise DatasetChangedError(f"file {name}", "absent", "present")
        for key in ("size", "records", "edges"):
            if before[name].get(key) != now[name].get(key):
                raise DatasetChangedError(f"file {name}: {key}", before[name].get(key), now[name].get(key))
        if "sha256" in before[name] and before[name]["sha256"] != now[name].get("sha256"):
            raise ContentChangedError(name, before[name]["sha256"], now[name].get("sha256"))
    if [f["name"] for f in recorded.get("files", [])] != [f["name"] for f in current.get("files", [])]:
        raise DatasetChangedError("file order", [f["name"] for f in recorded["files"]],
                                  [f["name"] for f in current["files"]])
    if not has_content(recorded):
        current = {**current, "digest": digest_of([{k: v for k, v in f.items() if k != "sha256"}
                                                   for f in current.get("files", [])], current.get("record_bytes"))}
    for key in ("record_bytes", "num_records", "digest"):
        if recorded.get(key) != current.get(key):
            raise DatasetChangedError(key, recorded.get(key), current.get(key))
