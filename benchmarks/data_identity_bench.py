"""Data identity benchmark: what a start-up's content check costs next to a plain open of the same files.

Writes --size_mib MiB of record files into a temporary folder with the repository's writer
(trainer/input/shards.py's write_shard: ArrayRecord, group_size:1, each shard's size, mtime and
sha256 recorded as prepare records them) and a metadata.json, then times, in --repeats rounds that
alternate them, `open_records` of the files (plain and stat --cheap_samples times a round):

  plain       the content digests taken from nothing: the open as it was before them (each file's
              record count and first and last records, Grain's source)
  stat        --check_data=stat, the default: each digest from metadata.json (a stat per file)
  full        --check_data=full: every file hashed, from the page cache (the files were just written)
  full, cold  the same with each file's pages dropped first (posix_fadvise DONTNEED): hashed from disk

A user's own files without metadata.json cost `full` at their first start (then the digest cache
vouches for them, as metadata.json does). The records are incompressible random tokens, so the files
hold --size_mib MiB. Ratios of medians against plain are the result; the folder is deleted at the end.

  PYTHONPATH=. .venv/bin/python -m benchmarks.data_identity_bench [--size_mib=1024] [--repeats=3]
"""

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from absl import flags

from benchmarks import common
from runtime import entry

_SIZE_MIB = flags.DEFINE_integer("size_mib", 1024, "MiB of record files written and opened.", lower_bound=1)
_SHARD_MIB = flags.DEFINE_integer("shard_mib", 64, "MiB per record file.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Rounds, each timing every variant once.", lower_bound=1)
_CHEAP_SAMPLES = flags.DEFINE_integer("cheap_samples", 5, "plain and stat, alternated, this many times a round: "
                                      "each takes milliseconds, so one sample a round cannot tell them apart.",
                                      lower_bound=1)

TOKENS_PER_RECORD = 1025  # --seq_len=1024
VARIANTS = ("plain", "stat", "full", "full, cold")


def write_dataset(folder: str, size_mib: int, shard_mib: int) -> dict:
    """Shards of random int32 tokens (incompressible) until the files hold size_mib MiB; their metadata.json."""
    from trainer.input import shards

    rng, written, total = np.random.default_rng(0), [], 0
    row_bytes = TOKENS_PER_RECORD * 4
    while total < size_mib << 20:
        rows = min(shard_mib << 20, (size_mib << 20) - total) // row_bytes + 1
        tokens = rng.integers(0, 2**31 - 1, size=(rows, TOKENS_PER_RECORD), dtype=np.int32)
        written.append(shards.write_shard(os.path.join(folder, f"train-{len(written):05d}.array_record"), tokens))
        total += written[-1]["size"]
    metadata = {"tokens_per_record": TOKENS_PER_RECORD, "dtype": "int32",
                "splits": {"train": {"glob": "train-*.array_record", "records": sum(s["records"] for s in written),
                                     "shards": written}}}
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump(metadata, f)
    return metadata


@contextlib.contextmanager
def without_digests():
    """open_records as it was before content digests: no digest taken, no file stat'ed or read for one."""
    from trainer.input import digests, records

    real = records.digests_lib.content_digests
    records.digests_lib.content_digests = lambda paths, names, metadata, check, cache_dir=None: (
        [""] * len(paths), digests.Tally(check))
    try:
        yield
    finally:
        records.digests_lib.content_digests = real


def drop_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages are dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_open(pattern: str, variant: str, paths: list[str]) -> float:
    from trainer.input import open_records

    if variant == "full, cold":
        drop_from_page_cache(paths)
    context = without_digests() if variant == "plain" else contextlib.nullcontext()
    with context:
        began = time.perf_counter()
        dataset = open_records(f"records:{pattern}", seed=0, check_data="full" if "full" in variant else "stat")
        secs = time.perf_counter() - began
    expected = 0 if variant in ("plain", "stat") else len(paths)
    assert dataset.digest_tally.hashed == expected, (variant, dataset.digest_tally)
    return secs


def main(argv) -> None:
    meter = common.LoadMeter()
    folder = tempfile.mkdtemp(prefix="data_identity_bench-")  # under $TMPDIR, as every benchmark's scratch
    cache = tempfile.mkdtemp(prefix="data_identity_bench-cache-")
    os.environ["XDG_CACHE_HOME"] = cache  # not this user's digest cache: nothing of the run stays behind
    try:
        began = time.perf_counter()
        metadata = write_dataset(folder, _SIZE_MIB.value, _SHARD_MIB.value)
        write_secs = time.perf_counter() - began
        shards = metadata["splits"]["train"]["shards"]
        paths = [os.path.join(folder, s["name"]) for s in shards]
        pattern = os.path.join(folder, "train-*.array_record")
        time_open(pattern, "plain", paths)  # warm-up: imports, the first open of each file
        secs = {variant: [] for variant in VARIANTS}
        for _ in range(_REPEATS.value):
            for variant in ("full, cold", "full"):  # the hash reads every page back: the rest run warm
                secs[variant].append(time_open(pattern, variant, paths))
            for _ in range(_CHEAP_SAMPLES.value):
                for variant in ("plain", "stat"):
                    secs[variant].append(time_open(pattern, variant, paths))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    mib = sum(s["size"] for s in shards) / 2**20
    print(f"data identity benchmark: {len(shards)} files, {mib:.0f} MiB, {metadata['splits']['train']['records']} "
          f"records of {TOKENS_PER_RECORD} tokens (written and hashed once in {write_secs:.2f} s), {_REPEATS.value} "
          f"repeats; other load {meter.other_cores():.2f} cores, load average {meter.load_average_at_start[0]:.2f}")
    for label, value in rows(secs, mib):
        print(f"  {label:<52} {value}")


def rows(secs: dict[str, list[float]], mib: float) -> list[tuple[str, str]]:
    """(label, value) of each result: medians, their samples, the ratios to plain and the hash rates."""
    median = {variant: statistics.median(samples) for variant, samples in secs.items()}
    out = [(f"open_records, {variant}: ms (median)", f"{1e3 * median[variant]:.1f}") for variant in VARIANTS]
    out += [(f"open_records, {variant}: ms (samples)", ",".join(f"{1e3 * s:.1f}" for s in secs[variant]))
            for variant in VARIANTS]
    out += [(f"ratio: {variant} / plain", f"{median[variant] / median['plain']:.2f}") for variant in VARIANTS[1:]]
    out += [(f"{variant}: GiB/s hashed", f"{mib / 1024 / median[variant]:.2f}") for variant in VARIANTS[2:]]
    return out

if __name__ == "__main__":
    entry.run(main)
