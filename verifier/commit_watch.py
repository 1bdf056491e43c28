"""What --follow waits on while idle: one stat of the directories a commit changes, not a listing.

Listing the committed steps and planning (Orbax's step scan, a verdict and a manifest read per
committed step) is too costly to repeat every few milliseconds, so the verifier used to poll on a
backoff (--poll_secs doubling up to --max_poll_secs) and a new commit's first verdict waited for
most of it. On a local disk an Orbax commit is a rename of `checkpoints/<step>.orbax-checkpoint-tmp-*`
to `checkpoints/<step>`, which changes the mtime (and on most filesystems the ctime or size) of
`checkpoints/`; a probe (checkpointing/_src/probes.py, what a save's complete verdict waits for) lands
by a rename into `probes/` the same way. So the idle verifier stats those two directories every
TICK_SECS and lists again as soon as either changed, or when the backoff delay ends: the backoff
stays the fallback for a change the signature cannot show. A gs:// workdir has no directory
mtimes: there only the backoff runs, as before.

Only process 0 watches (verifier/verifier.py): it decides when every process lists again. It also
tells when each commit landed, from which a replay forecasts the next and leaves the verifier's devices
free for it (next_commit_window, verifier/forecast.py), and which saves are being written.
"""

import os
import threading
import time

from checkpointing.verification import durable
from checkpointing.verification import workdir as workdir_lib

TICK_SECS = 0.015  # one stat per directory per tick: a commit is noticed within about this long
# A timestamp is only as fine as the filesystem's clock (a kernel tick on ext4, 2 s on FAT): a second
# change within RACY_SECS of the one seen can leave the same signature. A signature taken that soon
# after its change is checked once more when RACY_SECS have passed (git's "racily clean" rule).
RACY_SECS = 1.0
WINDOW_INTERVALS = 4  # the commit intervals a forecast looks back on (next_commit_window)
IN_FLIGHT_MARK = ".orbax-checkpoint-tmp"  # Orbax's `<step>.orbax-checkpoint-tmp-<time>`: a save being written
_RACY_NS = int(RACY_SECS * 1e9)

# (st_mtime_ns, st_ino, st_size, st_ctime_ns) of each watched directory; None where it does not exist
# yet (the verifier may start before the trainer creates it).
Signature = tuple[tuple[int, int, int, int] | None, ...]


class CommitWatch:
    """Tells when `checkpoints/` or `probes/` of a local workdir changed since it last looked."""

    def __init__(self, workdir: str, tick_secs: float = TICK_SECS):
        self._paths = [str(workdir_lib.checkpoints_dir(workdir)), str(workdir_lib.probes_dir(workdir))] \
            if durable.is_local(workdir) else []
        self._tick_secs = tick_secs
        self._seen: Signature = ()
        self._settled_ns: int | None = None  # wall-clock time a racy signature is looked at again
        self._look()

    @property
    def watching(self) -> bool:
        """False on gs://: wait() then only sleeps out its timeout (the backoff)."""
        return bool(self._paths)

    def wait(self, timeout_secs: float, stop: threading.Event) -> bool:
        """Returns True once changed() is, False once `timeout_secs` passed or `stop` is set."""
        deadline = time.monotonic() + timeout_secs
        while not stop.is_set():
            if self.changed():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            stop.wait(min(self._tick_secs, remaining) if self._paths else remaining)
        return False

    def commit_times(self, newest: int = WINDOW_INTERVALS + 1) -> dict[int, float]:
        """{step: its commit's wall-clock time} of the `newest` committed steps in checkpoints/ (a rename
        sets the renamed directory's ctime): a forecast needs only those, so a long run's retained steps
        cost one listing, not a stat each, between replayed steps. Always empty on gs://."""
        times = {}
        for name in sorted((name for name in self._checkpoint_names() if name.isdigit()), key=int)[-newest:]:
            try:
                times[int(name)] = os.stat(os.path.join(self._paths[0], name)).st_ctime
            except OSError:  # deleted meanwhile (retention)
                continue
        return times

    def in_flight_steps(self) -> set[int]:
        """Steps whose save is being written (a tmp directory in checkpoints/); always empty on gs://."""
        return set(self.in_flight_dirs())

    def in_flight_dirs(self) -> dict[int, str]:
        """{step: its tmp directory} of the saves being written; always empty on gs://."""
        dirs = {}
        for name in self._checkpoint_names():
            step = name.partition(".")[0]
            if IN_FLIGHT_MARK in name and step.isdigit():
                dirs[int(step)] = os.path.join(self._paths[0], name)
        return dirs

    def committed_dir(self, step: int) -> str | None:
        """A committed step's directory (None on gs://)."""
        return os.path.join(self._paths[0], str(step)) if self._paths else None

    def wait_for_commit(self, newer_than: int | None, timeout_secs: float, stop: threading.Event) -> None:
        """Returns once a step above `newer_than` is committed, `timeout_secs` passed or `stop` is set."""
        deadline = time.monotonic() + timeout_secs
        while not stop.is_set():
            if any(name.isdigit() and (newer_than is None or int(name) > newer_than)
                   for name in self._checkpoint_names()):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            stop.wait(min(self._tick_secs, remaining))

    def _checkpoint_names(self) -> set[str]:
        if not self._paths:
            return set()
        try:
            return {entry.name for entry in os.scandir(self._paths[0])}
        except OSError:  # not created yet
            return set()

    def changed(self) -> bool:
        """One look: whether a watched directory differs from the last look, or a racy look is due
        again (always False on gs://). A True is reported once: the caller lists after it."""
        if not self._paths:
            return False
        before, racy_due = self._seen, self._settled_ns is not None and time.time_ns() >= self._settled_ns
        self._look()
        return self._seen != before or racy_due

    def _look(self) -> None:
        signatures, now_ns, racy = [], time.time_ns(), []
        for path in self._paths:
            try:
                info = os.stat(path)
            except OSError:  # not created yet (or unreadable: the backoff's listing will say why)
                signatures.append(None)
                continue
            signatures.append((info.st_mtime_ns, info.st_ino, info.st_size, info.st_ctime_ns))
            if abs(now_ns - info.st_mtime_ns) < _RACY_NS:
                racy.append(info.st_mtime_ns + _RACY_NS)
        self._seen = tuple(signatures)
        self._settled_ns = max(racy) if racy else None


def next_commit_window(commit_times: dict[int, float], step_secs: float) -> tuple[float, float] | None:
    """(earliest, latest) wall-clock time the next commit is expected: saves come at a cadence (steps or
    seconds), so one of the last WINDOW_INTERVALS intervals after the newest commit, the shortest to the
    longest, and half a replay step more (`step_secs`). None before two commits. The spread matters: in
    the verifier benchmark the intervals vary by about a second, more than a replay step."""
    times = [commit_times[step] for step in sorted(commit_times)[-WINDOW_INTERVALS - 1:]]
    intervals = [later - earlier for earlier, later in zip(times, times[1:])]
    if not intervals:
        return None
    return times[-1] + min(intervals), times[-1] + max(intervals) + 0.5 * step_secs
