"""A watchdog that turns a wait that never returns into a failure exit.

Barriers, collectives with a dead or stopped peer, commits and restores can block forever. The
loop pets the watchdog at every step and every phase names its own bound; if a bound passes, the
process logs what it was waiting for and exits with FAILURE, so the scheduler restarts the job
instead of a pod hanging until someone notices.
"""

import contextlib
import os
import sys
import threading
import time

from absl import logging

from runtime import exit_codes


class Watchdog:
    def __init__(self, timeout_secs: float, clock=time.monotonic):
        self.timeout_secs = timeout_secs
        self._clock = clock
        self._lock = threading.Lock()
        self._what, self._deadline = "start-up", clock() + timeout_secs
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def pet(self, what: str, timeout_secs: float | None = None) -> None:
        """Progress: `what` is next, and must finish within `timeout_secs` (default: the watchdog's)."""
        with self._lock:
            self._what = what
            self._deadline = self._clock() + (self.timeout_secs if timeout_secs is None else timeout_secs)

    @contextlib.contextmanager
    def bounded(self, what: str, timeout_secs: float):
        self.pet(what, timeout_secs)
        try:
            yield
        finally:
            self.pet(f"after {what}")

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(0.5):
            with self._lock:
                late = self._clock() - self._deadline
                what = self._what
            if late > 0:
                logging.error("watchdog: %s did not finish in time (a dead or stuck peer?); exiting with code %d",
                              what, exit_codes.FAILURE)
                sys.stderr.flush()
                os._exit(exit_codes.FAILURE)
