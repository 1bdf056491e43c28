"""Shared test helpers: configs, meshes, and real subprocesses that are always reaped."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import numpy as np

from launch import pod as pod_lib
from trainer import model_config
from trainer.config import TrainConfig
from trainer.program import validate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUCKET = "ckpt-tests"  # the GCS emulator's and the S3 server's bucket (conftest.gcs_env, conftest.s3_env)
# helpers.small_config's run from the command line (saving every 10 steps).
SMALL_FLAGS = ["--mesh=data=4,model=2", "--batch_size=32", "--log_every_steps=5", "--save_every_steps=10"]

# The runs most slow tests share (conftest.trained_copy), with "steps" added: helpers.small_config
# saving every 10 steps and deleting none. Each is trained once per session.
SHARED_RUN = {"save_every_steps": 10, "max_to_keep": 100}

MESHES = {
    "data=8": (("data", 8),),
    "data=4,model=2": (("data", 4), ("model", 2)),
    "data=2,model=4": (("data", 2), ("model", 4)),
    "model=8": (("model", 8),),
}


def small_config(workdir: str, model: str = "mlp", mesh: str = "data=4,model=2", **overrides) -> TrainConfig:
    """A config small enough for a unit test; transformer sizes shrunk to keep CPU time low."""
    sizes = {"seq_len": 16, "hidden_dim": 32} if model == "transformer" else {}
    sizes.update(overrides)
    config = model_config.from_flat({"workdir": workdir, "model": model, "mesh": MESHES[mesh], "batch_size": 32,
                                    "log_every_steps": 5, **sizes})
    return validate(config, jax.device_count())


def subprocess_env(device_count: int = 8, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={device_count}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_module(module: str, *flags: str, device_count: int = 8, timeout: float = 300, **env):
    """Runs `python -m module flags...` to completion (killed on timeout) and returns the result."""
    return subprocess.run([sys.executable, "-m", module, *flags], env=subprocess_env(device_count, **env),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """After SIGSTOP: waits until every thread of `pid` is stopped (state T in /proc), so a snapshot of what
    it writes taken next cannot race a write still in flight; TimeoutError if one is not."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped after {timeout}s: thread states {states}")
        time.sleep(0.01)


@contextlib.contextmanager
def started_module(module: str, *flags: str, device_count: int = 8, log_path: str | None = None, **env):
    """Starts `python -m module` in its own process group; always killed (by PID) on exit."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", module, *flags], env=subprocess_env(device_count, **env),
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if log_path:
            log.close()


def leaves_by_path(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def leaves_equal(a, b) -> bool:
    """Same key paths, and every leaf equal bit for bit (dtype included)."""
    a, b = leaves_by_path(a), leaves_by_path(b)
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def max_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b), "loss lists cover different steps"
    x = np.array([a[s] for s in sorted(a)])
    y = np.array([b[s] for s in sorted(b)])
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-30)))


def checkpoint_dir(workdir: str, name: str = "") -> str:
    """<workdir>/checkpoints[/name]: where Orbax keeps the steps of a run (name: a step or a tmp dir)."""
    from checkpointing._src import workdir as workdir_lib

    return str(workdir_lib.checkpoints_dir(workdir) / name) if name else str(workdir_lib.checkpoints_dir(workdir))


def run_python(script: str, device_count: int = 8, timeout: float = 300, **env):
    """Runs a Python snippet in a fresh process with `device_count` fake devices."""
    return subprocess.run([sys.executable, "-c", script], env=subprocess_env(device_count, **env), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


# --- fault outcomes (tests/test_faults.py) ----------------------------------------------------------

def snapshot(path: str) -> dict[str, str] | None:
    """{relative path: sha256 of the bytes} of every file under `path`, directories as "dir"; None if
    `path` does not exist. Two equal snapshots mean nothing was created, changed or deleted."""
    import hashlib

    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return {".": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return found


def committed_snapshot(workdir: str) -> dict[int, dict[str, str]]:
    """Each committed step's files and their hashes."""
    from checkpointing._src.workdir import committed_steps

    return {step: snapshot(checkpoint_dir(workdir, str(step))) for step in committed_steps(workdir)}


def assert_committed_intact(before: dict[int, dict[str, str]], workdir: str) -> None:
    """Every step committed `before` is still committed with the same bytes, or moved whole to superseded/."""
    from checkpointing._src import workdir as workdir_lib

    now = committed_snapshot(workdir)
    superseded = str(workdir_lib.superseded_dir(workdir))
    moved = {name.split("-")[0]: snapshot(os.path.join(superseded, name))
             for name in (os.listdir(superseded) if os.path.isdir(superseded) else []) if "verdict" not in name}
    for step, files in before.items():
        assert now.get(step) == files or moved.get(str(step)) == files, f"committed step {step} was lost or changed"


def fault_line(result, code: int) -> str:
    """Asserts the command exited `code` with no traceback on stderr; returns stderr's last line."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{result.stderr[-3000:]}"
    assert lines and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[-1]


def strace() -> str:
    """strace's path (a Debian package .ci/run installs): under CI a missing one fails, elsewhere it skips."""
    import pytest

    found = shutil.which("strace")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("strace is not installed; .ci/run must install it (apt-get install strace)")
        pytest.skip("strace is not installed (apt-get install strace); CI installs it and runs these tests")
    return found


def gs_workdir(name: str) -> str:
    """A fresh workdir in the emulator's bucket."""
    return f"gs://{BUCKET}/{name}-{time.monotonic_ns()}"


def s3_workdir(name: str) -> str:
    """A fresh workdir in the S3 server's bucket (conftest.s3_env)."""
    return f"s3://{BUCKET}/{name}-{time.monotonic_ns()}"


# --- bad input: exit 2, one line, nothing changed ---------------------------------------------------

DiskState = dict[str, "dict[str, tuple[int, int] | str] | None"]


def disk_state(*paths: str) -> DiskState:
    """{path: None if missing, else {relative path: (size, mtime_ns) of a file, or "dir"}} of each
    path and everything under it. A directory's own mtime is left out: the trainer's writability
    probe (a file created and deleted) moves it without changing anything a reader could see."""
    state = {}
    for path in paths:
        if not os.path.isdir(path):
            stat = os.lstat(path) if os.path.lexists(path) else None
            state[path] = stat and {".": (stat.st_size, stat.st_mtime_ns)}
            continue
        found = {}
        for root, dirs, files in os.walk(path):
            found.update({os.path.relpath(os.path.join(root, name), path): "dir" for name in dirs})
            for name in files:
                stat = os.lstat(os.path.join(root, name))
                found[os.path.relpath(os.path.join(root, name), path)] = (stat.st_size, stat.st_mtime_ns)
        state[path] = found
    return state


def assert_refused(result, before: DiskState, *expected: str) -> str:
    """Bad input: exit 2, stderr exactly one `error: ` line containing every `expected` text (no log
    line before it: a refused run logs nothing), and every path of `before` (a disk_state taken before
    the command) as it was, a missing one still missing. Returns the line."""
    assert result.returncode == 2, f"exit {result.returncode}, expected 2:\n{result.stderr[-3000:]}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr:\n{result.stderr[-3000:]}"
    assert lines[0].startswith("error: ") and all(text in lines[0] for text in expected), lines[0]
    now = disk_state(*before)
    assert now == before, f"changed on disk: {_difference(before, now)}"
    return lines[0]


def _difference(before: DiskState, now: DiskState) -> dict[str, str | list[str]]:
    changed = {}
    for path, was in before.items():
        if now[path] != was:
            changed[path] = ("created" if was is None else "deleted" if now[path] is None else
                             sorted(name for name in {*was, *now[path]} if was.get(name) != now[path].get(name)))
    return changed


def run_in_process(main, *flag_args: str) -> subprocess.CompletedProcess:
    """Runs an entry point's `main` as `python -m` would (runtime/entry.py: flags parsed, a bad one
    exit 2; main's errors mapped to exit codes), in this process. The flags are unparsed again and
    the hooks runtime.entry installs are put back, so each call starts alike."""
    from absl import flags
    from absl import logging as absl_logging

    from runtime import entry, exit_codes

    argv = ["main", *flag_args]
    hooks = (sys.excepthook, threading.excepthook, sys.unraisablehook)
    handler = absl_logging.get_absl_handler()
    filters = list(handler.filters)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            try:
                code = entry.exit_code_of(main, exit_codes.parse_flags_or_exit(argv))
            except SystemExit as exit_:
                code = exit_.code or 0
    finally:
        flags.FLAGS.unparse_flags()
        sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
        handler.filters[:] = filters
    return subprocess.CompletedProcess(argv, code, "", stderr.getvalue())


def open_service(config: TrainConfig, program):
    """The trainer's persistent tier for `config`, without a lease: for tests that save or restore one
    step directly (the trainer itself opens it through checkpointing.Checkpointer)."""
    from checkpointing._src.service import CheckpointService, RunMetadata

    run = RunMetadata.of_run(config.to_json(), model_config.fixed_names(config), dict(program.mesh.shape),
                             program="trainer.program:replay_program")
    return CheckpointService(config.workdir, config.checkpoint, run=run)


def pod_results(child_module: str, num_processes: int, devices_per_process: int, flags: list[str] = (),
                timeout: float = 120) -> dict[int, dict]:
    """Runs `child_module` with `flags` on a real pod (launch/pod.py) and returns each process's "RESULT <json>"
    line by process index; asserts every process exited 0, and kills any still running."""
    output = io.StringIO()
    pod, pumps = pod_lib.start_pod(child_module, list(flags), num_processes=num_processes,
                                   devices_per_process=devices_per_process, output=output)
    try:
        codes = [proc.wait(timeout=timeout) for proc in pod.processes]
    finally:
        pod.signal_all(signal.SIGKILL)  # any still running
    for pump in pumps:
        pump.join(timeout=10)
    assert codes == [0] * num_processes, output.getvalue()[-3000:]
    results = {}
    for line in output.getvalue().splitlines():
        index, _, text = line.partition("] RESULT ")
        if text:
            results[int(index.lstrip("["))] = json.loads(text)
    assert sorted(results) == list(range(num_processes)), output.getvalue()[-3000:]
    return results


def start_test_server(module: str, bucket: str, ready: str, name: str, *, cwd: str, env: dict[str, str] | None,
                      output, new_session: bool, timeout: float, method: str = "GET") -> tuple[subprocess.Popen, str]:
    """`python -m module --port=P --bucket=bucket` on a free port of 127.0.0.1, once `ready` (a path on it) answers:
    (its process, which the caller stops by PID, and its URL). One that exits or stays silent is killed first."""
    from launch.pod import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", module, f"--port={port}", f"--bucket={bucket}"],
                              cwd=cwd, env=env or dict(os.environ), stdout=output, stderr=subprocess.STDOUT,
                              start_new_session=new_session)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url + ready, method=method), timeout=1).close()
            return server, url
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                server.wait(timeout=30)
                raise RuntimeError(f"the {name} did not start") from None
            time.sleep(0.1)
