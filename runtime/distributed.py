"""Multi-controller start-up shared by the trainer and the verifier: one process per host.

Where the process count comes from, in order:
  --coordinator_address/--num_processes/--process_id   explicit (the local pod launcher uses these)
  Slurm (SLURM_JOB_ID with SLURM_NTASKS > 1)           jax.distributed.initialize() reads the job
  Cloud TPU pod (TPU_WORKER_HOSTNAMES lists > 1 host)  jax.distributed.initialize() with no arguments
  otherwise                                            a single process; nothing to initialize
After initialization JAX's preemption notifier owns SIGTERM: see runtime/preemption.py.

Before that, start-up is guarded (`hold_sigterm`, which the trainer calls before it even imports
JAX, an import of about a second): a SIGTERM (or a Ctrl-C, SIGINT) is a preemption that came early,
so the process exits 75 at once with nothing to save, even while initialize() is blocked in C++
waiting for its peers;
and a peer that never connects is one line and exit 1 after --initialization_timeout_secs, not
the runtime's abort (rc 134) after five minutes.

JAX is imported inside the functions, so that importing this module does not import it.
"""

import os
import signal
import socket
import sys
import threading
import time

from absl import flags, logging

from runtime import exit_codes

COORDINATOR_ADDRESS = flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (one per host).", lower_bound=1)
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).", lower_bound=0)
HEARTBEAT_TIMEOUT_SECS = flags.DEFINE_integer(
    "heartbeat_timeout_secs", 30, "A peer silent this long is declared dead and the job stops.", lower_bound=5)
INITIALIZATION_TIMEOUT_SECS = flags.DEFINE_integer(
    "initialization_timeout_secs", 300, "Longest start-up waits for every process to connect before exiting 1.",
    lower_bound=1)

# The runtime's own limit is set past ours: when it expires it aborts the process.
_RUNTIME_TIMEOUT_MARGIN_SECS = 30
# The signals that mean "preempted": a scheduler's SIGTERM and a person's Ctrl-C (SIGINT).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _exit_now(code: int, line: str) -> None:
    """One line on stderr and exit from any thread (the main one may be blocked in C++)."""
    logging.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


class _StartupGuard:
    """Owns SIGTERM and SIGINT and a deadline until the distributed runtime has started.

    Python runs signal handlers only between the main thread's bytecodes, and initialize() blocks
    the main thread in C++ for as long as peers are missing. So both signals are blocked in every
    thread (threads started later inherit the mask) and taken here with sigtimedwait.
    """

    def __init__(self, holds_sigterm: bool):
        self.holds_sigterm = holds_sigterm
        if holds_sigterm:
            signal.pthread_sigmask(signal.SIG_BLOCK, set(PREEMPTION_SIGNALS))
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._released = threading.Event()
        self._taken_late: int | None = None  # a signal taken while release() ran: sent again
        self._thread = threading.Thread(target=self._watch, name="startup-guard", daemon=True)
        self._thread.start()

    def bound(self, timeout_secs: float, what: str) -> None:
        with self._lock:
            self._deadline, self._what = time.monotonic() + timeout_secs, what

    def _watch(self) -> None:
        while not self._released.is_set():
            if not self.holds_sigterm:
                self._released.wait(0.1)
            elif (taken := signal.sigtimedwait(PREEMPTION_SIGNALS, 0.1)) is not None:
                if self._released.is_set():  # raced with release(): hand it on
                    self._taken_late = taken.si_signo
                    return
                _exit_now(exit_codes.PREEMPTED,
                          f"preempted before start-up ({signal.Signals(taken.si_signo).name} before the distributed "
                          f"runtime started): nothing to save; exiting {exit_codes.PREEMPTED} so the scheduler "
                          "requeues the job")
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
            if late:
                _exit_now(exit_codes.FAILURE, f"error: {self._what}")

    def release(self) -> None:
        """The signals go back to the process (JAX's notifier, or the handlers the caller installs)."""
        self._released.set()
        self._thread.join()
        if not self.holds_sigterm:
            return
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PREEMPTION_SIGNALS))  # a pending one is delivered now
        if self._taken_late is not None:
            os.kill(os.getpid(), self._taken_late)


_guard: _StartupGuard | None = None


def hold_sigterm() -> None:
    """From now until initialize() has started the runtime, SIGTERM or SIGINT exits 75 at once. Call first
    thing."""
    global _guard
    if _guard is None:
        _guard = _StartupGuard(holds_sigterm=True)


def _preempted_before_training(signum, frame) -> None:
    logging.warning("%s before training started: nothing to save; exiting %d so the scheduler requeues the job",
                    signal.Signals(signum).name, exit_codes.PREEMPTED)
    sys.exit(exit_codes.PREEMPTED)


def sigint_as_sigterm(signum, frame) -> None:
    """With the runtime, JAX's notifier owns SIGTERM: a Ctrl-C becomes that same pod-wide preemption."""
    logging.warning("SIGINT: treated as SIGTERM, a preemption")
    os.kill(os.getpid(), signal.SIGTERM)


def _release_guard(single_process: bool) -> None:
    global _guard
    if _guard is None:
        return
    guard, _guard = _guard, None
    if single_process and guard.holds_sigterm:  # no notifier: exit 75 until the trainer installs its handlers
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, _preempted_before_training)
    elif guard.holds_sigterm:  # the notifier has SIGTERM; a Ctrl-C is sent on to it
        signal.signal(signal.SIGINT, sigint_as_sigterm)
    guard.release()


def _scheduler_runs_many_processes() -> str | None:
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu"
    return None


def initialize() -> None:
    """Starts the JAX distributed runtime if this is a multi-process job; call before any JAX work."""
    import jax

    timeout_secs = INITIALIZATION_TIMEOUT_SECS.value
    common = dict(heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECS.value,
                  initialization_timeout=timeout_secs + _RUNTIME_TIMEOUT_MARGIN_SECS)
    if COORDINATOR_ADDRESS.value:
        source = "flags"
        if NUM_PROCESSES.value is None or PROCESS_ID.value is None:
            raise ValueError("--coordinator_address needs --num_processes and --process_id")
        if PROCESS_ID.value >= NUM_PROCESSES.value:
            raise ValueError(f"--process_id={PROCESS_ID.value} must be below --num_processes={NUM_PROCESSES.value}")
        _bound_start_up(f"process {PROCESS_ID.value} of {NUM_PROCESSES.value}: not every process connected to the "
                        f"coordinator at {COORDINATOR_ADDRESS.value} within {timeout_secs}s "
                        "(--initialization_timeout_secs)")
        if PROCESS_ID.value > 0:
            await_coordinator(COORDINATOR_ADDRESS.value)
        jax.distributed.initialize(coordinator_address=COORDINATOR_ADDRESS.value, num_processes=NUM_PROCESSES.value,
                                   process_id=PROCESS_ID.value, **common)
    elif (source := _scheduler_runs_many_processes()) is not None:
        _bound_start_up(f"not every process of the {source} job connected to its coordinator within {timeout_secs}s "
                        "(--initialization_timeout_secs)")
        jax.distributed.initialize(**common)
    else:
        _release_guard(single_process=True)
        return
    _release_guard(single_process=False)
    logging.info("process %d of %d (from %s), %d local devices of %d", jax.process_index(), jax.process_count(),
                 source, jax.local_device_count(), jax.device_count())


def await_coordinator(address: str, poll_secs: float = 0.01) -> None:
    """Returns once the coordinator at host:port accepts a TCP connection (start-up's deadline bounds it).

    A gRPC client that finds nobody listening waits out its first reconnect backoff, a second, before
    trying again; processes start in no particular order, so a peer that raced process 0 lost about
    a second of every relaunch. Knocking first costs one connection.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--coordinator_address={address} must be host:port")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:port
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(poll_secs)


def _bound_start_up(what: str) -> None:
    global _guard
    if _guard is None:  # the verifier: a deadline only, its SIGTERM handling stays its own
        _guard = _StartupGuard(holds_sigterm=False)
    _guard.bound(INITIALIZATION_TIMEOUT_SECS.value, what)


def is_multiprocess() -> bool:
    import jax

    return jax.process_count() > 1
