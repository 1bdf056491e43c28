"""Real read errors for tests: a command run while strace fails the reads of chosen files with EIO
(tests/test_read_errors.py, tests/test_verifier_errors.py)."""

import glob
import os
import signal
import subprocess
import sys
import time

from tests import helpers


def array_files(workdir: str, steps) -> list[str]:
    """The array data files of `steps` (what a restore reads)."""
    return sorted(path for step in steps for path in glob.glob(
        os.path.join(helpers.checkpoint_dir(workdir, str(step)), "state", "**", "d", "*"), recursive=True))


def _strace_eio(trace, pid: int, files: list[str]) -> subprocess.Popen:
    """strace attached to `pid` (its threads, and those it starts), failing every read of `files` with EIO."""
    paths = [arg for path in files for arg in ("-P", path)]
    return subprocess.Popen([helpers.strace(), "-f", "-qq", "-o", str(trace), "-p", str(pid), *paths,
                             "-e", "trace=pread64,read,preadv", "-e", "inject=pread64,read,preadv:error=EIO"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_under_eio(tmp_path, module: str, flags: list[str], files: list[str], *, until: str | None = None):
    """`python -m module flags` while every read of `files` fails with EIO: to the end, or until its log shows
    `until` (then strace detaches, and the reads succeed again). Returns (its result with its log as stderr,
    how many reads were failed). strace attaches long before any restore: JAX takes seconds to import."""
    log_path, trace = tmp_path / f"{module}.log", tmp_path / "strace.out"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", module, *flags], env=helpers.subprocess_env(),
                                   cwd=helpers.REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log)
    tracer = _strace_eio(trace, process.pid, files)
    try:
        if until is not None:
            deadline = time.monotonic() + 120
            while until not in log_path.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            tracer.send_signal(signal.SIGTERM)  # detaches: the process goes on, its reads no longer fail
        tracer.wait(timeout=60)
        process.wait(timeout=300)
    finally:
        for running in (tracer, process):
            if running.poll() is None:
                running.kill()
                running.wait(timeout=30)
    result = subprocess.CompletedProcess(process.args, process.returncode, "", log_path.read_text())
    return result, trace.read_text().count("(INJECTED)")
