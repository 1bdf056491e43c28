"""Processes of a local pod: start them, relay their output, bound their exits, decide the pod's code.

The pod's code is what a scheduler acts on (runtime/exit_codes.py):
  0   every process succeeded
  75  requeue: every process exited 0 or 75 (a preemption, saved); or a process died of SIGTERM,
      whoever sent it (preempted before it had a handler, within about 0.1 s of its start: nothing
      to save, nothing is lost); or a process was
      LOST, killed by SIGKILL from outside the pod (the OOM killer, a lost node). When a peer is
      lost the runtime itself aborts the survivors (a C++ check failure, -6, once
      --heartbeat_timeout_secs passes; the abort cannot be intercepted from Python). Nothing
      committed is lost either way, and a requeue resumes from the latest committed step.
  2   bad input (any process exited 2)
  1   anything else (a crash: a blind restart may loop)
A process that exits 75 (or dies of SIGTERM) while its peers still run makes the launcher forward
SIGTERM to them at once: a
preemption of one process is a preemption of the pod (a peer still waiting for it at start-up
would otherwise wait out its timeout).
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import logging

from runtime import exit_codes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Pod:
    processes: list[subprocess.Popen]
    killed: set[int] = dataclasses.field(default_factory=set)  # sent SIGKILL by the launcher

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def signal_all(self, signum: int) -> None:
        for index, proc in enumerate(self.processes):
            if proc.poll() is None:
                proc.send_signal(signum)
                if signum == signal.SIGKILL:
                    self.killed.add(index)

    def kill(self, index: int) -> None:
        self.killed.add(index)
        self.processes[index].kill()

    def lost(self) -> list[int]:
        """Processes killed by SIGKILL from outside the pod (not by this launcher)."""
        return [i for i, p in enumerate(self.processes) if p.returncode == -signal.SIGKILL and i not in self.killed]

    def codes(self) -> list[int]:
        """Exit codes, a death by SIGTERM counted as preempted: the launcher's own or a scheduler's that
        came before the process had a handler (it had nothing to save)."""
        return [exit_codes.PREEMPTED if p.returncode == -signal.SIGTERM else p.returncode for p in self.processes]


def start_pod(module: str, flags_: list[str], num_processes: int, devices_per_process: int,
              output=sys.stdout) -> tuple[Pod, list[threading.Thread]]:
    """Starts the processes and one thread per stream (stdout, stderr) copying it with a '[i] ' prefix."""
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    processes, pumps = [], []
    lock = threading.Lock()
    for index in range(num_processes):
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *flags_, f"--coordinator_address={address}",
             f"--num_processes={num_processes}", f"--process_id={index}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        processes.append(proc)
        # A pipe and a pump per stream: XLA's C++ (gloo's "connected to 1 peer ranks") writes stdout a
        # piece at a time, and one shared pipe spliced the process's error line into the middle of it.
        for stream in (proc.stdout, proc.stderr):
            pump = threading.Thread(target=_copy_lines, args=(stream, f"[{index}] ", output, lock), daemon=True)
            pump.start()
            pumps.append(pump)
    return Pod(processes), pumps


def _copy_lines(stream, prefix: str, output, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            output.write(prefix + line)
            output.flush()


def wait_pod(pod: Pod, peer_exit_grace_secs: float) -> int:
    """Waits for every process (killing stragglers after the grace) and returns the pod's exit code."""
    first_exit, forwarded = None, False
    while any(p.poll() is None for p in pod.processes):
        if first_exit is None and any(p.poll() is not None for p in pod.processes):
            first_exit = time.monotonic()
        if not forwarded and any(p.poll() in (exit_codes.PREEMPTED, -signal.SIGTERM) for p in pod.processes):
            forwarded = True
            logging.warning("a process was preempted (exit %d or SIGTERM): SIGTERM to the others",
                            exit_codes.PREEMPTED)
            pod.signal_all(signal.SIGTERM)
        if first_exit is not None and time.monotonic() - first_exit > peer_exit_grace_secs:
            for index, proc in enumerate(pod.processes):
                if proc.poll() is None:
                    logging.error("process %d did not exit %.0fs after a peer did; killing it", index,
                                  peer_exit_grace_secs)
                    pod.kill(index)
        time.sleep(0.1)
    return pod_exit_code(pod.codes(), lost=pod.lost())


def pod_exit_code(codes: list[int], lost: list[int] = ()) -> int:
    """The pod's code from its processes' codes; `lost`: processes SIGKILLed from outside (see above)."""
    if all(code == exit_codes.OK for code in codes):
        return exit_codes.OK
    if all(code in (exit_codes.OK, exit_codes.PREEMPTED) for code in codes):
        return exit_codes.PREEMPTED
    if exit_codes.BAD_INPUT in codes:
        return exit_codes.BAD_INPUT
    if lost:
        return exit_codes.PREEMPTED
    return exit_codes.FAILURE


def run_pod(module: str, flags_: list[str], num_processes: int, devices_per_process: int,
            peer_exit_grace_secs: float = 30.0) -> int:
    pod, pumps = start_pod(module, flags_, num_processes, devices_per_process)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: pod.signal_all(signal.SIGTERM))
    logging.info("pod of %d processes: pids %s", num_processes, pod.pids)
    try:
        code = wait_pod(pod, peer_exit_grace_secs)
    finally:
        pod.signal_all(signal.SIGKILL)  # stragglers wait_pod left (an exception, a signal)
    for pump in pumps:
        pump.join(timeout=5)
    if pod.lost():
        logging.warning("process(es) %s were killed by SIGKILL from outside the pod (lost); the latest committed "
                        "checkpoint is intact: exiting %d so the job is requeued", pod.lost(), code)
    logging.info("pod exit codes %s -> %d", [p.returncode for p in pod.processes], code)
    return code
