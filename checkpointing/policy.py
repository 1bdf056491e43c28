"""When to save. One decision per step, identical on every process."""

import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils


class SavePolicy:
    """Decides whether a step is saved, and why: final, preemption, interval or time.

    Step-based reasons are the same on every process by construction. Clocks are not: the time
    reason is decided by process 0 and broadcast, so hosts never disagree about a save (a host
    that saves alone waits forever in Orbax's barriers). The clock is injectable for tests.
    """

    def __init__(self, save_every_steps: int = 0, save_every_secs: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.save_every_steps = save_every_steps
        self.save_every_secs = save_every_secs
        self._clock = clock
        self._last_save_time = clock()

    def reason(self, step: int, *, final: bool = False, preempted: bool = False) -> str | None:
        if preempted:
            return "preemption"
        if final:
            return "final"
        if self.save_every_steps and step % self.save_every_steps == 0:
            return "interval"
        if self.save_every_secs and self._time_is_due():
            return "time"
        return None

    def saved(self) -> None:
        self._last_save_time = self._clock()

    def _time_is_due(self) -> bool:
        due = self._clock() - self._last_save_time >= self.save_every_secs
        if jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due
