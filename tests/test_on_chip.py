"""On the accelerator itself (a TPU chip): a run killed after a commit resumes to the uninterrupted run's loss
list bit for bit, the verifier on the chip reproduces every step bit for bit, and the same run verified on the
host CPU never fails a genuine step (platforms compute otherwise: inconclusive at worst, docs/verifier.md).

Marked `chip`, run where JAX finds an accelerator, one program at a time (the chip admits one):

    python3 -m pytest -m chip tests/test_on_chip.py        # benchmarks/device_run.sh's set-up first

Everywhere else (CI has no accelerator) each test is skipped and says why. Whether JAX finds one is asked in a
child process, so this process never holds the chip that the trainers it starts need.
"""

import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from checkpointing._src.workdir import committed_steps
from checkpointing._src import verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import verdict_file
from tests import helpers

pytestmark = [pytest.mark.chip, pytest.mark.slow]

STEPS, EVERY = 200, 20  # a few seconds of training after the first commit: the kill lands before the end
MODEL = ["--model=transformer", "--hidden_dim=256", "--num_layers=2", "--num_heads=4", "--seq_len=64",
         "--vocab_size=1024", "--batch_size=8", "--mesh=data=1", f"--save_every_steps={EVERY}", "--max_to_keep=100"]


def chip_env(**extra: str) -> dict[str, str]:
    """This environment without the test suite's CPU settings: JAX picks the accelerator."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [helpers.REPO_ROOT, env.get("PYTHONPATH")])), **extra)


@functools.cache
def accelerator() -> str | None:
    """JAX's backend where it is not the CPU, asked in a child; None at once where no accelerator can be (no
    TPU device file, and CHIP_TESTS unset: benchmarks/device_run.sh sets it)."""
    if not (os.environ.get("CHIP_TESTS") or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/*")):
        return None
    code = "import jax; print(jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", code], env=chip_env(), capture_output=True, text=True, timeout=300)
    backend = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
    return backend if backend not in (None, "cpu") else None


@pytest.fixture(autouse=True, scope="module")  # module scope: before `uninterrupted` trains anything
def on_the_chip():
    if accelerator() is None:
        pytest.skip("no accelerator here, only the CPU (on a device machine: bash benchmarks/device_run.sh tests)")


def train(workdir: str, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.train", f"--workdir={workdir}", *MODEL, *flags],
                          env=chip_env(), cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def verify(workdir: str, env: dict, *flags: str, project: str = helpers.REPO_ROOT) -> dict[int, dict]:
    result = subprocess.run([sys.executable, "-m", "verifier.verify", f"--workdir={workdir}", "--once", *flags],
                            env=env, cwd=project, capture_output=True, text=True, timeout=600)
    # 1: a failing verdict, 3: an unproved one (inconclusive across platforms), asserted on below
    assert result.returncode in (0, 1, 3), result.stderr[-3000:]
    return verdicts.read_all(workdir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    workdir = str(tmp_path_factory.mktemp("chip") / "uninterrupted")
    result = train(workdir, f"--steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory) -> str:
    """A run of two saves (20 and 40) for the host CPU's tests: there a verifier's start-up takes about 100 s and each
    chip step about 20 s more (measured on a v5e's host), and what they show holds step by step."""
    workdir = str(tmp_path_factory.mktemp("chip") / "two_saves")
    result = train(workdir, f"--steps={2 * EVERY}")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def test_a_run_killed_after_a_commit_resumes_to_the_uninterrupted_loss_list_bit_for_bit(uninterrupted, tmp_path):
    workdir = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "-m", "trainer.train", f"--workdir={workdir}", *MODEL,
                             f"--steps={STEPS}"], env=chip_env(), cwd=helpers.REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while EVERY not in committed_steps(workdir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the kill landed before the run ended"
    killed_at = committed_steps(workdir)
    assert killed_at and killed_at[-1] < STEPS, killed_at
    result = train(workdir, f"--steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step {killed_at[-1]}" in result.stderr
    assert recorded_losses(workdir) == recorded_losses(uninterrupted)
    assert sorted(recorded_losses(workdir)) == list(range(STEPS))


def test_the_verifier_on_the_chip_reproduces_every_step_bit_for_bit(uninterrupted):
    found = verify(uninterrupted, chip_env(), "--mesh=data=1")
    assert {s: (found[s]["level"], found[s]["status"]) for s in committed_steps(uninterrupted)} == \
        {s: ("reproduced", "pass") for s in committed_steps(uninterrupted)}, json.dumps(found)[-3000:]


def test_the_chip_run_verified_on_the_host_cpu_from_another_checkout_fails_no_genuine_step(two_saves, tmp_path):
    """Another checkout of the same code (copied elsewhere, no git): the same computation, so never "code changed";
    across platforms each step passes or is inconclusive for the platform."""
    copy = str(tmp_path / "copy")
    shutil.copytree(two_saves, copy, symlinks=True)
    shutil.rmtree(verdict_file(copy, 0).parent, ignore_errors=True)  # this verifier's verdicts only
    checkout = shutil.copytree(helpers.REPO_ROOT, tmp_path / "checkout", ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl-tpu", "__pycache__", "device-bench-out"))
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and os.path.abspath(p) != helpers.REPO_ROOT]
    env = helpers.subprocess_env(4, PYTHONPATH=os.pathsep.join([str(checkout), *others]))  # JAX's wheels stay found
    found = verify(copy, env, "--mesh=data=4", project=str(checkout))
    statuses = {s: (found[s]["status"], found[s]["detail"]) for s in committed_steps(copy)}
    assert all(status in ("pass", "inconclusive") for status, _ in statuses.values()), statuses
    assert any("recorded on TPU" in detail for _, detail in statuses.values()), statuses
    assert not any("code changed" in detail or "computation" in detail for _, detail in statuses.values()), statuses


# A child on the host CPU (this process never holds the chip): step 40's params x (1 + 1e-3 noise), saved with
# fingerprints of its own, the manifest's platform put back to the chip's (what a chip trainer bug would save).
TAMPER = """
import json, sys
from checkpointing._src import manifest as manifest_lib, workdir as workdir_lib
from tests import tamper
from trainer import model_config
from trainer.program import validate
workdir, step = sys.argv[1], int(sys.argv[2])
recorded = workdir_lib.read_manifest(workdir, step)
config = model_config.from_json({**recorded["config"], "workdir": workdir})
tamper.rewrite_step(validate(config, 1), step, tamper.perturb_params, keep_saved_fingerprints=False)
path = workdir_lib.manifest_file(workdir, step)
manifest = json.loads(path.read_text())
manifest["platform"] = recorded["platform"]
manifest["digest"] = manifest_lib.digest(manifest)
path.write_text(json.dumps(manifest))
"""


def test_a_wrong_chip_step_is_not_passed_on_the_host_cpu(two_saves, tmp_path):
    """A step the chip saved wrong (params x (1 + 1e-3 noise), fingerprints its own): on the host CPU its proof is
    never a pass (inconclusive across platforms, or a fail); the steps before it are not failed."""
    copy = str(tmp_path / "copy")
    shutil.copytree(two_saves, copy, symlinks=True)
    shutil.rmtree(verdict_file(copy, 0).parent, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", TAMPER, copy, "40"], env=helpers.subprocess_env(1),
                          cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = verify(copy, helpers.subprocess_env(4), "--mesh=data=4")
    assert found[40]["status"] in ("fail", "inconclusive"), found[40]["detail"]
    assert found[20]["status"] in ("pass", "inconclusive"), found[20]["detail"]
