"""Content digests of record files: the sha256 of each file's bytes, taken once and checked cheaply.

A dataset is identified by its content (docs/data.md#the-datasets-identity). Only hashing proves the
bytes, and it reads every file (0.7-0.8 s per GiB here from the page cache, 0.9-1.05 s from the
disk: benchmarks/data_identity_bench.py), so a start-up takes a file's digest from a record that
vouches for the file's current (size, mtime_ns), and hashes it only where none does:

  stat  (--check_data's default) prepare's metadata.json, which records each shard's size, mtime_ns
        and sha256 as it writes it (trainer/input/shards.py), else this host's digest cache; a file
        neither vouches for is hashed and the cache keeps its digest. Every write moves a file's
        mtime, so an edit in place or a fresh prepare is hashed again; an edit that puts the size
        and the mtime back (touch -r, os.utime) is not: only `full` sees it.
  full  every file hashed at every start-up (the cache refreshed).

The cache lives on local disk, never beside the data: a data folder may be read-only, a bucket
mount or shared by many jobs, and metadata.json is prepare's record of what it wrote, so nothing
here rewrites it. It is $XDG_CACHE_HOME (else ~/.cache)/jax-checkpoint-service/data-digests/, one
JSON per data folder ({file name: [size, mtime_ns, sha256]}), replaced atomically; when one is
written, entries of files that are gone and caches of folders that are gone are dropped. An
unusable cache costs a hash, never a run.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
import time

from trainer.input.errors import DataError, RecordFileError

STAT, FULL = "stat", "full"
CHECKS = (STAT, FULL)
CHUNK_BYTES = 8 << 20
Stat = tuple[int, int]  # (size, mtime_ns)


@dataclasses.dataclass
class Tally:
    """Where one dataset's digests came from: logged once a run is admitted, and what tests count."""

    check: str
    metadata: int = 0  # vouched for by prepare's metadata.json
    cache: int = 0  # by this host's digest cache
    hashed: int = 0
    hashed_bytes: int = 0
    hash_secs: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. a cache that could not be written

    def describe(self) -> str:
        return (f"{self.metadata} from prepare's metadata.json, {self.cache} from the digest cache, {self.hashed} "
                f"hashed ({self.hashed_bytes / 2**20:.1f} MiB in {self.hash_secs:.2f} s; --check_data={self.check})")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-checkpoint-service", "data-digests")


def file_sha256(path: str) -> str:
    digest, buffer = hashlib.sha256(), bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def stat_of(path: str) -> Stat:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def shard_facts(path: str) -> dict:
    """What prepare records of a shard it has just written: its size, mtime_ns and sha256."""
    before = stat_of(path)
    return {"size": before[0], "mtime_ns": before[1], "sha256": _hash_unchanging(path, before)}


def _hash_unchanging(path: str, before: Stat) -> str:
    digest = file_sha256(path)
    if stat_of(path) != before:
        raise RecordFileError(path, "changed while its content was hashed (is something writing it?)")
    return digest


def prepared(metadata: dict | None) -> dict[str, tuple[int, int, str]]:
    """{shard name: (size, mtime_ns, sha256)} of prepare's metadata.json (none from a prepare before digests)."""
    found = {}
    for split in ((metadata or {}).get("splits") or {}).values():
        for shard in split.get("shards", []):
            if {"name", "size", "mtime_ns", "sha256"} <= set(shard):
                found[shard["name"]] = (shard["size"], shard["mtime_ns"], shard["sha256"])
    return found


def content_digests(paths: list[str], names: list[str], metadata: dict | None, check: str,
                    cache_dir: str | None = None) -> tuple[list[str], Tally]:
    """The sha256 of each file's bytes (files named `names` in `metadata`), per `check`, and their tally."""
    if check not in CHECKS:
        raise DataError(f"--check_data={check}: expected {' or '.join(CHECKS)}")
    tally, known = Tally(check), prepared(metadata)
    caches: dict[str, FolderCache] = {}  # opened only for a file metadata.json does not vouch for
    digests = []
    for path, name in zip(paths, names):
        try:
            now = stat_of(path)
        except FileNotFoundError:
            raise RecordFileError(path, "missing") from None
        vouched = known.get(name) if known.get(name, (None, None))[:2] == now else None
        if check == STAT and vouched:
            tally.metadata += 1
            digests.append(vouched[2])
            continue
        folder = os.path.dirname(os.path.realpath(path))
        if folder not in caches:
            caches[folder] = FolderCache(folder, cache_dir or default_cache_dir())
        cache = caches[folder]
        cached = cache.lookup(os.path.basename(path), now) if check == STAT else None
        if cached is not None:
            tally.cache += 1
            digests.append(cached)
            continue
        began = time.perf_counter()
        digests.append(_hash_unchanging(path, now))
        tally.hashed, tally.hashed_bytes = tally.hashed + 1, tally.hashed_bytes + now[0]
        tally.hash_secs += time.perf_counter() - began
        cache.store(os.path.basename(path), now, digests[-1])
        if vouched and vouched[2] != digests[-1]:
            tally.notes.append(f"{path}: its bytes differ from the sha256 prepare recorded for its size and mtime "
                               "(an edit that put the mtime back?)")
    tally.notes += [note for note in (cache.save() for cache in caches.values()) if note]
    return digests, tally


class FolderCache:
    """This host's digests of one folder's files: {name: [size, mtime_ns, sha256]} in one JSON file."""

    def __init__(self, folder: str, cache_dir: str):
        self.folder, self.cache_dir = folder, cache_dir
        self.path = os.path.join(cache_dir, hashlib.sha256(folder.encode()).hexdigest()[:32] + ".json")
        self.entries, self.changed = self._load(), False

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                saved = json.load(f)
            return dict(saved["files"]) if saved.get("folder") == self.folder else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}  # none yet, or damaged: the files are hashed and the cache written anew

    def lookup(self, name: str, now: Stat) -> str | None:
        entry = self.entries.get(name)
        return entry[2] if isinstance(entry, list) and len(entry) == 3 and tuple(entry[:2]) == now else None

    def store(self, name: str, now: Stat, digest: str) -> None:
        if self.entries.get(name) != [*now, digest]:
            self.entries[name], self.changed = [*now, digest], True

    def save(self) -> str | None:
        """Writes the cache if it changed (files that are gone left out); a note if it could not."""
        if not self.changed:
            return None
        files = {name: entry for name, entry in self.entries.items()
                 if os.path.exists(os.path.join(self.folder, name))}
        staged = None
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            handle, staged = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
            with os.fdopen(handle, "w") as f:
                json.dump({"folder": self.folder, "files": files}, f)
            os.replace(staged, self.path)  # readers see the old cache or the new one, never a torn one
            self._drop_folders_gone()
        except OSError as err:
            if staged is not None and os.path.exists(staged):
                os.remove(staged)
            return f"digest cache {self.cache_dir} not written ({err.strerror or err}): the next start hashes again"
        return None

    def _drop_folders_gone(self) -> None:
        """Removes the caches of folders that no longer exist (temporary datasets), so the cache stays small."""
        for name in os.listdir(self.cache_dir):
            path = os.path.join(self.cache_dir, name)
            if not name.endswith(".json") or path == self.path:
                continue
            try:
                with open(path) as f:
                    folder = json.load(f)["folder"]
                if not os.path.isdir(folder):
                    os.remove(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # another process's write under way, or not ours: left alone
