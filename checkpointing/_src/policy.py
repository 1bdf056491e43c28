"""When to save. One decision per step, identical on every process."""

import math
import time
from typing import Callable

from runtime import collective


class SavePolicy:
    """Decides whether a step is saved, and why: final, preemption, interval or time.

    Step-based reasons are the same on every process by construction. Clocks are not: the time
    reason is decided by process 0 and broadcast, so hosts never disagree about a save (a host
    that saves alone waits forever in Orbax's barriers). A broadcast is a collective, so it is not
    made every step: each one also carries the step of the next check, about half the time left
    (at most MAX_CHECK_GAP_SECS) ahead at the step rate process 0 measured. The save lands within
    about a step of its time after a few broadcasts. The clock is injectable for tests.
    """

    MAX_CHECK_GAP_SECS = 10.0  # a shorter interval set meanwhile (auto) is noticed within this

    def __init__(self, save_every_steps: int = 0, save_every_secs: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.save_every_steps = save_every_steps
        self.save_every_secs = save_every_secs
        self._clock = clock
        self._last_save_time = clock()
        self._next_check_step = 0
        self._last_check: tuple[int, float] | None = None  # (step, time) of process 0's last check

    def reason(self, step: int, *, final: bool = False, preempted: bool = False) -> str | None:
        if preempted:
            return "preemption"
        if final:
            return "final"
        if self.save_every_steps and step % self.save_every_steps == 0:
            return "interval"
        if self.save_every_secs and step >= self._next_check_step and self._time_is_due(step):
            return "time"
        return None

    def saved(self) -> None:
        self._last_save_time = self._clock()

    def _time_is_due(self, step: int) -> bool:
        now = self._clock()
        left = self.save_every_secs - (now - self._last_save_time)
        due = not left > 0
        steps_ahead = 1
        if not due and self._last_check is not None and step > self._last_check[0]:
            secs_per_step = (now - self._last_check[1]) / (step - self._last_check[0])
            gap = 0.5 * left if 0.5 * left <= self.MAX_CHECK_GAP_SECS else self.MAX_CHECK_GAP_SECS
            if secs_per_step > 0:
                steps_ahead = max(1, min(int(gap / secs_per_step), 2**30))
        self._last_check = (step, now)
        due, steps_ahead = collective.broadcast_ints([due, steps_ahead])  # process 0's answer, for both
        self._next_check_step = step + steps_ahead
        return bool(due)


def p90(values) -> float | None:
    """The 90th percentile (nearest rank) of recent commit times; None before any was measured."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None


def young_daly_interval(cost_secs: float, mtbi_secs: float, *, step_secs: float, max_overhead: float,
                        max_interval_secs: float) -> float:
    """sqrt(2 C M) (Young 1974, Daly 2006), then bounded.

    The lower bound keeps saves below `max_overhead` of the time spent stepping (C / interval); it
    never drops below one step. The upper bound wins over both: a long run still saves that often.
    """
    interval = max(math.sqrt(2 * cost_secs * mtbi_secs), cost_secs / max_overhead, step_secs)
    # A NaN would make every time check false (never save): anything but a finite number caps.
    return interval if interval <= max_interval_secs else max_interval_secs


def mean_time_between_interruptions(interruptions: int, history_secs: float, prior_secs: float) -> float:
    """M from the workdir's history, smoothed by a prior of one interruption every `prior_secs`.

    Before any interruption M is prior + history (no interruption seen over that long), so a young
    run saves as if one came every `prior_secs`; each interruption pulls M towards history / count.
    """
    return (prior_secs + max(history_secs, 0.0)) / (interruptions + 1)


class AutoInterval:
    """`--save_every_secs=auto`: measures the cost C of this run's saves and chooses the interval.

    C is a save's blocking time plus the step slow-down while its background write runs (each
    step's wall time over the baseline of steps with no write in flight). Every process measures;
    only process 0's interval matters, since SavePolicy broadcasts process 0's time decision.
    """

    FIRST_INTERVAL_SECS = 60.0  # before any save was measured: save once soon to measure C

    def __init__(self, *, mtbi_secs: float, max_overhead: float, max_interval_secs: float,
                 cost_secs: float | None = None):
        self.mtbi_secs = mtbi_secs
        self.max_overhead = max_overhead
        self.max_interval_secs = max_interval_secs
        self.cost_secs = cost_secs
        self.step_secs: float | None = None  # baseline, no background write in flight
        self._blocking = 0.0
        self._slowdown = 0.0

    def interval(self) -> float:
        if self.cost_secs is None:
            return min(self.FIRST_INTERVAL_SECS, self.max_interval_secs)
        return young_daly_interval(self.cost_secs, self.mtbi_secs, step_secs=self.step_secs or 0.0,
                                   max_overhead=self.max_overhead, max_interval_secs=self.max_interval_secs)

    def step(self, secs: float, *, writing: bool) -> None:
        """One step's wall time; `writing` while a background save is in flight."""
        if writing:
            if self.step_secs is not None:
                self._slowdown += max(secs - self.step_secs, 0.0)
        else:  # a slow-moving baseline: one odd step moves it little
            self.step_secs = secs if self.step_secs is None else 0.9 * self.step_secs + 0.1 * secs

    def save_started(self, blocking_secs: float) -> None:
        self._blocking = blocking_secs
        self._slowdown = 0.0

    def committed(self) -> None:
        """The save in flight committed: its cost is known (averaged with the earlier ones)."""
        cost = self._blocking + self._slowdown
        self.cost_secs = cost if self.cost_secs is None else 0.5 * self.cost_secs + 0.5 * cost
