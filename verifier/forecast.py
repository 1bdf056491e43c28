"""When a replay leaves the verifier's devices free for a commit about to land (process 0, --follow).

A replayed step takes longer than a restore (0.7-0.9 s on one CPU core in the verifier benchmark,
against 0.4 s), and a commit landing during one waits for it before its intact proof starts. So between
replayed steps the verifier may wait for the commit instead:
- the save being written says its commit comes before the next replayed step would end (its bytes and
  their rate, verifier/write_progress.py); it waits that long and one replayed step more at most;
- else, unless no save has committed within a replayed step of being seen, a forecast from the cadence: the
  next commit's window (commit_watch.next_commit_window) opens before the next replayed step would end; it
  waits to the window's end at most;
- the run's final save is being written (an Orbax tmp directory of the manifest's `total_steps`): no
  training competes with that write, so it commits sooner than the cadence says (0.5-4 s before the
  window opened in the benchmark), and no replay step is started in front of it.
All waits together stay within PAUSE_SHARE of the replay time, so a commit that never comes costs a
replay at most that. Once the run's final save is committed nothing is awaited (a wait then cost a
replay up to 7 s).
"""

import collections
import threading
import time

from absl import logging

from checkpointing.errors import CheckpointError
from checkpointing.verification import read_manifest
from verifier.commit_watch import CommitWatch, next_commit_window
from verifier.write_progress import WriteProgress

# The share of its replay time a replay may spend waiting for commits: what first verdicts that do not wait
# for a replay step may cost the full proof's pace.
PAUSE_SHARE = 0.2
# A replay's first step takes longer than the ones after it (1.6-1.7 s against 1.4-1.5 s on a busy benchmark
# machine): the next step is judged by the longest of the last few, so that it does not start just before a
# window opens and end inside it.
RECENT_CHUNKS = 4


class CommitForecast:
    """Process 0's waits for commits between replayed steps, within their allowance."""

    def __init__(self, workdir: str, watch: CommitWatch):
        self._workdir, self._watch = workdir, watch
        self._allowance = 0.0  # seconds the replays may still wait
        self._recent: collections.deque = collections.deque(maxlen=RECENT_CHUNKS)  # time per step of each chunk
        self._newest: tuple[int, bool, int | None] | None = None  # (newest commit, final?, the run's total_steps)
        self._looked_at = self._newest_commit(watch.commit_times())  # the newest commit at the last look
        self._progress = WriteProgress(watch, started_at=time.time())

    def replayed(self, secs: float, steps: int) -> None:
        """A chunk of `steps` replayed steps took `secs`: PAUSE_SHARE of it may be spent waiting."""
        self._allowance += PAUSE_SHARE * secs
        self._recent.append(secs / steps)

    @property
    def _step_secs(self) -> float | None:
        """The next replayed step's time: the longest per step of the last RECENT_CHUNKS chunks."""
        return max(self._recent) if self._recent else None

    def keep_free(self, stop: threading.Event) -> None:
        """Between replayed steps: waits for a commit about to land (the module docstring), or returns at once
        when a commit landed since the last look (it is to be proved first)."""
        commits, now = self._watch.commit_times(), time.time()
        newest = self._newest_commit(commits)
        self._progress.look(commits, now)  # at every look: a write rate needs two of them
        landed, self._looked_at = newest != self._looked_at, newest
        if landed or self._allowance <= 0 or self._step_secs is None:
            return
        final, total_steps = self._newest_manifest(newest)
        if final:  # no commit follows the run's last save
            return
        if total_steps is not None and total_steps in self._watch.in_flight_steps():
            timeout, why = self._allowance, f"the final save of step {total_steps}, being written"
        else:
            wait = self._commit_due(commits, newest, now)
            if wait is None:
                return
            timeout, why = wait
        began = time.monotonic()
        self._watch.wait_for_commit(newest, timeout, stop)
        waited = time.monotonic() - began
        self._allowance -= waited
        logging.vlog(1, "waited %.2fs for %s; allowance left %.2fs", waited, why, self._allowance)

    def _commit_due(self, commits: dict[int, float], newest: int | None, now: float) -> tuple[float, str] | None:
        """(how long to wait, why) when the next commit may come before the next replayed step ends: from
        the save being written (verifier/write_progress.py), else from the last intervals; None: no wait."""
        estimate = self._progress.estimate(newest, now)
        if estimate is not None and estimate.secs >= self._step_secs:  # exact, or a bound: not within the step
            return None
        if estimate is not None and estimate.exact:
            return min(self._allowance, estimate.secs + self._step_secs), \
                f"{estimate.why}: a commit {estimate.secs:.2f}s ahead"
        window = next_commit_window(commits, self._step_secs)
        if window is None or now + self._step_secs < window[0] or now >= window[1]:
            return None
        return min(self._allowance, window[1] - now), \
            f"a forecast commit (window {window[0] - now:.2f}..{window[1] - now:.2f}s ahead)"

    @staticmethod
    def _newest_commit(commits: dict[int, float]) -> int | None:
        return max(commits) if commits else None

    def _newest_manifest(self, step: int | None) -> tuple[bool, int | None]:
        """(whether `step` is the run's final save, the run's total_steps): its manifest read once."""
        if step is None:
            return False, None
        if self._newest is None or self._newest[0] != step:
            try:
                manifest = read_manifest(self._workdir, step)
                self._newest = (step, manifest.get("reason") == "final", manifest.get("total_steps"))
            except CheckpointError:  # unreadable: its verdict will say so; forecast as before
                self._newest = (step, False, None)
        return self._newest[1], self._newest[2]
