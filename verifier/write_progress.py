"""How soon the save being written commits, from the bytes in its Orbax tmp directory (process 0, --follow).

The intervals between commits vary by about 2.5 s in the verifier benchmark (a save's write takes 5-10 s
on the trainer's core, training competing with it), more than a replayed step (0.7-1.5 s): a forecast
from them alone either waits long or lets a commit land inside a replayed step. A save's bytes grow
steadily to about the size of the newest committed checkpoint (its arrays' data files are nearly all of
it), and its commit follows the last of them within a second. In one benchmark run, 90% of the bytes were
written 0.9-1.4 s before the commit, 75% 1.6-2.2 s before, 99% 0.3-0.9 s before. So at each look between
replayed steps process 0 sums the in-flight save's file sizes, and from its write rate since a look at
least RATE_SECS earlier tells how soon the rest is written (`Estimate.exact`).

Without a rate (a save first seen at this look, or none started) it gives a lower bound instead: no save
has committed sooner after it was first seen than the shortest of the last few, measured the same way
(first seen at a look, so never longer than the write itself). A commit is never sooner than that.
Local workdirs only (the tmp directory is listed and its files stat'ed); a save with more than MAX_FILES
files is not measured (a many-host pod's shared filesystem, where that is a stat per file between steps).
"""

import collections
import dataclasses
import os

from verifier.commit_watch import WINDOW_INTERVALS, CommitWatch

RATE_SECS = 0.5  # a rate is measured over at least this long (looks between chunks can come ms apart)
NEAR_COMPLETE = 0.98  # of the newest checkpoint's bytes: the save's last small files and its rename are left
MIN_WRITES_TIMED = 2  # saves timed from first sight to commit before their shortest bounds the next
MAX_FILES = 512  # a save is measured only while its tmp directory holds at most this many files


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds to the next commit: `exact` from a write rate, else a lower bound; `why` for the log."""

    secs: float
    exact: bool
    why: str


def directory_bytes(path: str, max_files: int = MAX_FILES) -> int | None:
    """The sizes of the files under `path` summed; None when it holds more than `max_files` or is gone."""
    total, files, failed = 0, 0, []
    for root, _, names in os.walk(path, onerror=failed.append):
        files += len(names)
        if files > max_files:
            return None
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # renamed meanwhile (Orbax finalizing an item)
                continue
    # Gone (committed, or deleted) before its listing: no size. A subdirectory renamed meanwhile only
    # leaves its bytes out of this look.
    return None if failed and failed[0].filename == path else total


class WriteProgress:
    """What process 0 has seen of the saves being written, look by look."""

    def __init__(self, watch: CommitWatch, started_at: float):
        self._watch, self._started_at = watch, started_at
        self._samples: dict[int, list[tuple[float, int]]] = {}  # in-flight step: (time, bytes) at each look
        self._first_seen: dict[int, float] = {}
        self._writes: collections.deque = collections.deque(maxlen=WINDOW_INTERVALS)  # first seen -> commit, s
        self._timed: set[int] = set()  # commits whose write is in _writes
        self._sizes: dict[int, int | None] = {}  # committed step: its bytes (the newest only)

    def look(self, commits: dict[int, float], now: float) -> None:
        """Samples every save in flight; times each save that committed since the verifier started."""
        for step, path in self._watch.in_flight_dirs().items():
            written = directory_bytes(path)
            self._first_seen.setdefault(step, now)
            if written is not None:
                self._samples.setdefault(step, []).append((now, written))
        for step, committed_at in sorted(commits.items()):
            if step in self._timed or committed_at < self._started_at:
                continue
            self._timed.add(step)
            # Never seen in flight: its write was shorter than the gap between two looks, so no bound holds.
            seen = self._first_seen.get(step)
            self._writes.append(max(0.0, committed_at - seen) if seen is not None else 0.0)
        for step in [s for s in self._first_seen if s in commits or s < max(commits, default=-1)]:
            self._first_seen.pop(step)
            self._samples.pop(step, None)

    def estimate(self, newest: int | None, now: float) -> Estimate | None:
        """How soon a step above `newest` (the newest commit) commits; None when nothing here says."""
        in_flight = [step for step in self._first_seen if newest is None or step > newest]
        step = max(in_flight, default=None)
        total = self._size(newest)
        if step is not None and total:
            samples = self._samples.get(step, [])
            written = samples[-1][1] if samples else 0
            share = f"step {step}'s save {100 * written / total:.0f}% written"
            if written >= NEAR_COMPLETE * total:
                return Estimate(0.0, True, share)
            rate = _rate(samples)
            if rate:
                return Estimate((total - written) / rate, True, f"{share} at {rate / 2**20:.0f} MiB/s")
        if len(self._writes) < MIN_WRITES_TIMED or min(self._writes) <= 0:
            return None
        since = now - self._first_seen[step] if step is not None else 0.0
        return Estimate(max(0.0, min(self._writes) - since), False,
                        f"no save commits sooner than {min(self._writes):.2f}s after it is seen")

    def _size(self, step: int | None) -> int | None:
        if step is None:
            return None
        if step not in self._sizes:
            path = self._watch.committed_dir(step)
            self._sizes = {step: directory_bytes(path) if path else None}  # the newest only
        return self._sizes[step]


def _rate(samples: list[tuple[float, int]]) -> float | None:
    """Bytes per second from the newest sample back to the newest one at least RATE_SECS older."""
    if not samples:
        return None
    now, written = samples[-1]
    earlier = [(t, b) for t, b in samples if now - t >= RATE_SECS]
    if not earlier:
        return None
    then, before = earlier[-1]
    return (written - before) / (now - then) if written > before else None
