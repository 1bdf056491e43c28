"""One preemption decision per step, taken once and reused by every caller in that step.

With the JAX distributed runtime, SIGTERM to any one process is caught by JAX's preemption
notifier and every process learns the same safe step from `reached_preemption_sync_point`, which
must be called exactly once per step on every process (a second call for the same step has
answered differently on one host and deadlocked a pod in an un-timed barrier). Orbax asks again
inside save() and at finalization; the checkpoint service answers it from `decided()`.
A single process has no notifier: SIGTERM sets a flag that the next step's decision reads.
SIGINT (Ctrl-C) is a preemption too, everywhere: a single process handles it like SIGTERM; in a
multi-process job it is sent on as SIGTERM to JAX's notifier (runtime/distributed.py).

A second Ctrl-C to a single process (a SIGINT once either signal came) is a person who will not
wait: it exits INTERRUPTED (130) at once with one line naming the checkpoint it did not wait for and
the latest committed step. Nothing committed is touched: the save in flight never commits, and the
next start removes its temporary directory. A second SIGTERM still waits (a scheduler may repeat it).
"""

import signal
import threading
from typing import Callable

from absl import logging
from jax.experimental import multihost_utils

from runtime import distributed, exit_codes, logs
from runtime.causes import one_line_cause

# The second Ctrl-C's line names the latest committed step: a listing, which may not hang its exit.
_LISTING_WAIT_SECS = 1.0


class PreemptionWatch:
    def __init__(self):
        self._multiprocess = distributed.is_multiprocess()
        self._signalled = threading.Event()
        self._decisions: dict[int, bool] = {}
        self._preempted_at: int | None = None  # the step whose decision was yes: its checkpoint is being saved
        self._latest_committed: Callable[[], int | None] | None = None
        self._asked = 0  # decisions asked of the runtime so far in this process
        self._previous_handlers: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            if not self._multiprocess:
                handlers = {signum: self._on_signal for signum in distributed.PREEMPTION_SIGNALS}
            else:
                handlers = {signal.SIGINT: distributed.sigint_as_sigterm}
            self._previous_handlers = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}

    def close(self) -> None:
        """Gives the signals back to whoever had them (tests run the trainer in-process)."""
        for signum, handler in self._previous_handlers.items():
            if handler is not None:  # None: installed outside Python, nothing to put back
                signal.signal(signum, handler)
        self._previous_handlers = {}

    def reports_committed(self, latest_committed: Callable[[], int | None]) -> None:
        """Where a second Ctrl-C's line reads the latest committed step (the checkpoint service's listing)."""
        self._latest_committed = latest_committed

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self._signalled.is_set():
            logs.exit_at_once(exit_codes.INTERRUPTED, self._second_interrupt_line())
        again = "; a second Ctrl-C exits at once without it" if signum == signal.SIGINT else ""
        logging.warning("%s: saving at the next step boundary, then exiting for a requeue%s",
                        signal.Signals(signum).name, again)
        self._signalled.set()

    def _second_interrupt_line(self) -> str:
        pending = ("the checkpoint at the next step boundary" if self._preempted_at is None
                   else f"the checkpoint of step {self._preempted_at}")
        line = f"error: second interrupt: exiting now without waiting for {pending}"
        if self._latest_committed is not None:
            line += f"; the latest committed step is {self._read_latest_committed()}"
        return line

    def _read_latest_committed(self) -> str:
        """The listing on a thread of its own, waited for at most _LISTING_WAIT_SECS (a gs:// workdir whose
        endpoint stopped answering must not hold up an exit asked for twice)."""
        found: list = []

        def read() -> None:
            try:
                found.append(self._latest_committed())
            except Exception as err:  # noqa: BLE001  the line says so instead
                found.append(f"unknown ({one_line_cause(err)})")

        reader = threading.Thread(target=read, name="second-interrupt-listing", daemon=True)
        reader.start()
        reader.join(_LISTING_WAIT_SECS)
        return str(found[0]) if found else f"unknown (its listing took over {_LISTING_WAIT_SECS:g}s)"

    def decide(self, step: int) -> bool:
        """The decision for `step`; the runtime is asked only the first time per step."""
        if step not in self._decisions:
            if self._multiprocess:
                # The runtime's safe step is the largest id any process has passed, plus one, and a
                # process that has passed none counts as 0. A resumed run's first training step is
                # far above that, so a SIGTERM before its first decision would name a step the loop
                # never asks about, and be lost. Every process decides at the same steps, so the
                # index of the decision in this run is an id they agree on.
                decision = multihost_utils.reached_preemption_sync_point(self._asked)
                self._asked += 1
            else:
                decision = self._signalled.is_set()
            self._decisions = {step: decision}  # only the current step is ever asked again
            if decision:
                self._preempted_at = step
        return self._decisions[step]

    def decided(self, step: int) -> bool:
        """What `decide(step)` answered; never asks the runtime (False for a step not decided)."""
        return self._decisions.get(step, False)
