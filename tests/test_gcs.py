"""gs:// workdirs against a real GCS-protocol server on 127.0.0.1 (gcp-storage-emulator).

The server is started by conftest.gcs_env (tests/gcs_emulator.py) and stopped by PID; TensorStore
and gcsfs reach it through TENSORSTORE_GCS_HTTP_URL and STORAGE_EMULATOR_HOST.
"""

import os
import signal
import time

import pytest

from tests import helpers

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--log_every_steps=10"]


def run(module, *flags, gcs_env, device_count=8):
    result = helpers.run_module(module, *flags, device_count=device_count, **gcs_env)
    return result


def test_save_restore_retention_verify_and_inspect_on_gcs(gcs_env, tmp_path):
    from checkpointing._src import verdicts
    from checkpointing._src.report import recorded_losses
    from checkpointing._src.workdir import committed_steps

    workdir = helpers.gs_workdir("run")
    result = run("trainer.train", f"--workdir={workdir}", "--steps=40", "--max_to_keep=2", *TRAIN, gcs_env=gcs_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert committed_steps(workdir) == [30, 40], "retention keeps the newest two"
    verify = run("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", gcs_env=gcs_env, device_count=2)
    assert verify.returncode == 0, verify.stderr[-3000:]
    found = verdicts.read_all(workdir)
    # Retention deleted 10 and 20 first: step 30 is proved from the init, 40 from 30.
    assert [(s, v["level"], v["status"], v["replayed_from"]) for s, v in found.items()] == [
        (30, "reproduced", "pass", 0), (40, "reproduced", "pass", 30)]
    resumed = run("trainer.train", f"--workdir={workdir}", "--steps=50", "--max_to_keep=2", *TRAIN, gcs_env=gcs_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 40" in resumed.stderr
    assert committed_steps(workdir) == [40, 50]
    table = run("trainer.inspect", f"--workdir={workdir}", gcs_env=gcs_env)
    assert table.returncode == 0, table.stderr[-2000:]
    assert [row.split()[0] for row in table.stdout.strip().splitlines()[2:]] == ["40", "50"]  # after the shared line
    assert "reproduced pass" in table.stdout.splitlines()[2]
    local = str(tmp_path / "local")
    reference = helpers.run_module("trainer.train", f"--workdir={local}", "--steps=50", "--max_to_keep=100", *TRAIN)
    assert reference.returncode == 0
    assert recorded_losses(workdir) == {s: v for s, v in recorded_losses(local).items() if s >= 30}


def _uncommitted_steps(workdir: str) -> list[int]:
    """Step prefixes that exist in the bucket without Orbax's commit marker: saves in flight."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon")
    root = workdir[len("gs://"):] + "/checkpoints"
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True)]
    except FileNotFoundError:
        return []
    return [int(n) for n in names if n.isdigit() and not fs.exists(f"{root}/{n}/commit_success.txt")]


def test_kill_9_during_an_async_save_on_gcs_never_lists_that_step_and_the_resume_is_exact(gcs_env, tmp_path):
    from checkpointing._src.report import recorded_losses
    from checkpointing._src.workdir import committed_steps

    workdir = helpers.gs_workdir("killed")
    flags = [f"--workdir={workdir}", "--steps=60", "--max_to_keep=100", *TRAIN, "--hidden_dim=256"]
    killed_step = None
    with helpers.started_module("trainer.train", *flags, log_path=str(tmp_path / "killed.log"), **gcs_env) as proc:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            in_flight = [s for s in _uncommitted_steps(workdir) if s > 10]
            if in_flight and committed_steps(workdir):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                killed_step = in_flight[0]
                break
    assert killed_step is not None, "no save was caught in flight"
    assert killed_step not in committed_steps(workdir)
    result = run("trainer.train", *flags, gcs_env=gcs_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step {max(s for s in committed_steps(workdir) if s < killed_step)}" in result.stderr
    local = str(tmp_path / "local")
    reference = helpers.run_module("trainer.train", f"--workdir={local}", *flags[1:])
    assert reference.returncode == 0
    assert recorded_losses(workdir) == recorded_losses(local)


def test_follow_verifier_over_gcs(gcs_env, tmp_path):
    from checkpointing._src import verdicts

    workdir = helpers.gs_workdir("follow")
    with helpers.started_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--follow",
                                "--poll_secs=0.2", "--max_poll_secs=1", device_count=2,
                                log_path=str(tmp_path / "verifier.log"), **gcs_env) as verifier:
        result = run("trainer.train", f"--workdir={workdir}", "--steps=30", "--max_to_keep=100", *TRAIN,
                     gcs_env=gcs_env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert verifier.wait(timeout=240) == 0, open(tmp_path / "verifier.log").read()[-3000:]
    found = verdicts.read_all(workdir)
    assert [(s, v["level"], v["status"]) for s, v in found.items()] == [
        (10, "reproduced", "pass"), (20, "reproduced", "pass"), (30, "reproduced", "pass")]
