"""Processes of a local pod: start them, relay their output, bound their exits, decide the pod's code."""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import logging

from launch import exit_codes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Pod:
    processes: list[subprocess.Popen]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def signal_all(self, signum: int) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signum)


def start_pod(module: str, flags_: list[str], num_processes: int, devices_per_process: int,
              output=sys.stdout) -> tuple[Pod, list[threading.Thread]]:
    """Starts the processes and one thread per process copying its output with a '[i] ' prefix."""
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
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        processes.append(proc)
        pump = threading.Thread(target=_copy_lines, args=(proc.stdout, f"[{index}] ", output, lock), daemon=True)
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
    first_exit = None
    while any(p.poll() is None for p in pod.processes):
        if first_exit is None and any(p.poll() is not None for p in pod.processes):
            first_exit = time.monotonic()
        if first_exit is not None and time.monotonic() - first_exit > peer_exit_grace_secs:
            for index, proc in enumerate(pod.processes):
                if proc.poll() is None:
                    logging.error("process %d did not exit %.0fs after a peer did; killing it", index,
                                  peer_exit_grace_secs)
                    proc.kill()
        time.sleep(0.1)
    return pod_exit_code([p.returncode for p in pod.processes])


def pod_exit_code(codes: list[int]) -> int:
    if all(code == exit_codes.OK for code in codes):
        return exit_codes.OK
    if all(code in (exit_codes.OK, exit_codes.PREEMPTED) for code in codes):
        return exit_codes.PREEMPTED
    if exit_codes.BAD_INPUT in codes:
        return exit_codes.BAD_INPUT
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
        for proc in pod.processes:
            if proc.poll() is None:
                proc.kill()
    for pump in pumps:
        pump.join(timeout=5)
    logging.info("pod exit codes %s -> %d", [p.returncode for p in pod.processes], code)
    return code
