"""Helpers shared by the benchmarks: child processes, host memory, machine load, call probes.

Every measurement that must not see another's memory or allocator state runs in its own child
process (`run_child`), which prints one JSON line as its last line of stdout.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(devices: int) -> dict:
    """This environment, with `devices` fake CPU devices and the repository on the path."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    xla = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
                XLA_FLAGS=f"{xla} --xla_force_host_platform_device_count={devices}".strip())


def run_child(module: str, args: list[str], *, devices: int = 8, timeout_secs: float = 900) -> dict:
    """Runs `python -m module args` in its own process group; returns its last stdout line as JSON.

    Killed by PID (its whole group) on timeout; a failing child raises with its stderr's tail.
    """
    proc = subprocess.Popen([sys.executable, "-m", module, *args], env=child_env(devices), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_secs)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise RuntimeError(f"{module} {' '.join(args)}: killed after {timeout_secs:.0f}s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {' '.join(args)} exited {proc.returncode}:\n{err[-4000:]}")
    return json.loads(lines[-1])


def fresh_memory_fill_secs(mib: int = 256) -> float:
    """Seconds a new process takes to fill `mib` MiB it never touched (np.ones, after numpy's import).

    On a VM whose host takes back the memory a guest frees, this moved 20x within minutes (0.05-1.2 s
    for 260 MB, docs/performance.md), and every relaunch's restore and first steps pay it: a
    benchmark reports it with its rounds, so a reader can tell the machine's drift from the code's.
    """
    code = ("import time, numpy as np; began = time.perf_counter(); "
            f"np.ones({mib} * 2**20 // 8); print(time.perf_counter() - began)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.split()[-1])


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def reset_peak_rss() -> int:
    """Resets VmHWM (the peak RSS) to the current RSS, which it returns."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


def busy_cpu_secs() -> float:
    """CPU seconds the whole machine has been busy (all cores, steal included) since boot."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_secs() -> float:
    """CPU seconds of this process and its reaped children."""
    return sum(os.times()[:4])


class LoadMeter:
    """How busy the rest of the machine was while the benchmark ran, in cores."""

    def __init__(self):
        self._start = (time.monotonic(), busy_cpu_secs(), own_cpu_secs())
        self.load_average_at_start = os.getloadavg()

    def other_cores(self) -> float:
        wall, busy, own = (time.monotonic(), busy_cpu_secs(), own_cpu_secs())
        return ((busy - self._start[1]) - (own - self._start[2])) / max(wall - self._start[0], 1e-9)


class CallProbe:
    """Wraps `owner.name` (a module function or a class method) to count and time its calls.

    A benchmark row that names a code path reads its probe, and `require_called` raises when the
    code path no longer runs, so a moved call breaks the row instead of reading 0.
    """

    def __init__(self, owner, name: str):
        self.owner, self.name, self.calls, self.seconds = owner, name, 0, 0.0
        original = getattr(owner, name)

        def probe(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        setattr(owner, name, probe)

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__name__', self.owner)}.{self.name}"

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def require_called(self, where: str) -> None:
        if not self.calls:
            raise RuntimeError(f"{self.label} was not called by {where}: the benchmark row that times it "
                               "no longer measures that code path; update the benchmark")


def pin_caller() -> None:
    """--pin_caller: this (the calling) thread on the first allowed core, every other thread on the rest.
    Threads started later inherit their creator's cores, so it runs again before each case."""
    cores = sorted(os.sched_getaffinity(0) | set().union(*(os.sched_getaffinity(int(t))
                                                          for t in os.listdir("/proc/self/task"))))
    if len(cores) < 2:
        raise ValueError(f"--pin_caller needs 2 cores, this process may use {cores}")
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores[:1] if tid == me else cores[1:])
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile
