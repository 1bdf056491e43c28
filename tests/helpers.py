"""Shared test helpers: configs, meshes, and real subprocesses that are always reaped."""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys

import jax
import numpy as np

from trainer.config import TrainConfig, validate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    config = dataclasses.replace(TrainConfig(workdir=workdir, model=model, mesh=MESHES[mesh],
                                             batch_size=32, log_every_steps=5), **sizes)
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
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


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
    """<workdir>/checkpoints[/name]: where Orbax keeps the steps of a run."""
    return os.path.join(workdir, "checkpoints", name) if name else os.path.join(workdir, "checkpoints")


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
    from checkpointing.service import committed_steps

    return {step: snapshot(checkpoint_dir(workdir, str(step))) for step in committed_steps(workdir)}


def assert_committed_intact(before: dict[int, dict[str, str]], workdir: str) -> None:
    """Every step committed `before` is still committed with the same bytes, or moved whole to superseded/."""
    now = committed_snapshot(workdir)
    superseded = os.path.join(workdir, "superseded")
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


def assert_refused(result, before: dict[str, str] | None, watched: str, *expected: str) -> None:
    """Bad input: exit 2, exactly one `error:` line on stderr containing every `expected` text, and
    `watched` (the workdir, or the directory that would hold it) exactly as `before` (a snapshot)."""
    line = fault_line(result, 2)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert line.startswith("error: ") and all(text in line for text in expected), line
    assert snapshot(watched) == before, f"{watched} changed"
