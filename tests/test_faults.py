"""The fault matrix (issue 9, section 3; docs/faults.md): each fault is survived, or refused with one
clear line, and nothing committed is lost. Real parts: a real full disk (a small tmpfs), a closed
port for an unreachable gs:// endpoint; pods with real signals are in test_faults_pods.py.

Each test asserts the exit code, the last line of stderr (it names the step, the path or the
endpoint, and the cause) and that every committed step is still there with the same bytes.
"""

import errno
import importlib.util
import json
import os
import shutil
import subprocess

import jax.numpy as jnp
import pytest

from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from runtime import exit_codes
from launch.pod import free_port
from tests import helpers
from trainer import loop

pytestmark = pytest.mark.slow

SMALL = helpers.SMALL_FLAGS  # helpers.small_config's run, from the command line


# --- a full disk ----------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB file system (tmpfs), unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({result.stderr.strip()}); "
                    "the disk-full tests need a real full disk")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: str, leave_bytes: int = 0) -> str:
    """Fills `disk` with one file until ENOSPC, then frees `leave_bytes` of it; returns its path."""
    path = os.path.join(disk, "filler")
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    os.truncate(path, max(os.path.getsize(path) - leave_bytes, 0))
    return path


def trained(trained_copy, workdir: str, steps: int = 20) -> dict[int, dict[str, str]]:
    """A copy at `workdir` of the shared run of `steps` steps (helpers.SHARED_RUN: saves every 10 steps);
    returns its committed snapshot."""
    trained_copy(workdir, **helpers.SHARED_RUN, steps=steps)
    assert committed_steps(workdir) == list(range(10, steps + 1, 10))
    return helpers.committed_snapshot(workdir)


def test_disk_full_fails_the_save_in_one_line_naming_the_step_and_a_resume_works_once_space_is_freed(
        small_disk, trained_copy):
    workdir = os.path.join(small_disk, "run")
    before = trained(trained_copy, workdir)
    # Room for the lease and the metrics, not for a checkpoint (about 260 KiB).
    filler = fill(small_disk, leave_bytes=96 * 1024)
    command = ["trainer.train", f"--workdir={workdir}", "--steps=40", *SMALL]

    result = helpers.run_module(*command)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith("error: background save of step 30 failed: no space left on device"), line
    assert str(workdir_lib.step_dir(workdir, 30)) in line and "the latest committed step is still 20" in line, line
    assert len(result.stderr.splitlines()) < 30, result.stderr  # Orbax's tracebacks: one line each at most
    helpers.assert_committed_intact(before, workdir)

    fill(small_disk)  # the resume on the still-full disk
    result = helpers.run_module(*command)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith("error: ") and "no space left on device" in line.lower(), line
    assert len(result.stderr.splitlines()) < 30, result.stderr
    helpers.assert_committed_intact(before, workdir)

    os.remove(filler)
    result = helpers.run_module(*command)
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    assert "resumed from step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    helpers.assert_committed_intact(before, workdir)


def _killed_saves(workdir: str) -> list[str]:
    return [name for name in os.listdir(workdir_lib.checkpoints_dir(workdir)) if ".orbax-checkpoint-tmp" in name]


def test_a_full_disk_never_blocks_the_relaunch_that_would_free_it(small_disk, trained_copy):
    """The failed save's temporary directory is removed by the failing writer, and a killed writer's by the
    next one before it takes the lease: the lease's own write would otherwise meet the full disk, every time."""
    workdir = os.path.join(small_disk, "run")
    before = trained(trained_copy, workdir)
    filler = fill(small_disk, leave_bytes=512 * 1024)  # a checkpoint is about 220-260 KiB
    command = ["trainer.train", f"--workdir={workdir}", "--steps=40", *SMALL]
    with open(os.path.join(small_disk, "ballast"), "wb") as f:
        f.write(b"\0" * 400 * 1024)  # the save of step 30 starts, and fills the disk
    result = helpers.run_module(*command)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith("error: background save of step 30 failed: no space left on device"), line
    assert "removed the temporary directory of the failed save: ['30.orbax-checkpoint-tmp" in result.stderr
    assert _killed_saves(workdir) == []
    os.remove(os.path.join(small_disk, "ballast"))
    # Once the leftover below is gone, the relaunch saves steps 30 and 40: room for both and their metrics.
    os.truncate(filler, max(os.path.getsize(filler) - 512 * 1024, 0))

    # A writer killed mid-save (nothing of it could clean up) left a temporary directory that fills the disk.
    leftover = os.path.join(str(workdir_lib.checkpoints_dir(workdir)), "30.orbax-checkpoint-tmp")
    os.makedirs(leftover)
    fill(leftover)
    result = helpers.run_module(*command)
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    assert "removed the temporary directories of saves that never committed: ['30.orbax-checkpoint-tmp']" \
        in result.stderr
    assert "resumed from step 20" in result.stderr and committed_steps(workdir)[-1] == 40
    helpers.assert_committed_intact(before, workdir)
    os.remove(filler)


def test_disk_full_verdict_write_is_one_line_and_leaves_no_tmp_file(small_disk, trained_copy):
    workdir = os.path.join(small_disk, "run")
    before = trained(trained_copy, workdir, steps=10)
    os.makedirs(os.path.join(workdir, workdir_lib.VERDICTS_DIR), exist_ok=True)
    fill(small_disk)

    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                "--replay_steps=1", device_count=2)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    path = workdir_lib.verdict_file(workdir, 10)
    assert line == f"error: verdict of step 10: cannot write {path}: no space left on device", line
    assert os.listdir(os.path.join(workdir, workdir_lib.VERDICTS_DIR)) == [], "no tmp file and no partial verdict"
    helpers.assert_committed_intact(before, workdir)


def test_disk_full_metrics_append_warns_and_training_goes_on(small_disk, caplog):
    workdir = os.path.join(small_disk, "run")
    os.makedirs(workdir)
    metrics = os.path.join(workdir, workdir_lib.METRICS_FILE)
    # Just under one 4 KiB page of records: the next append fits only partly, then hits ENOSPC.
    kept = ""
    for step in range(100):
        line = json.dumps({"step": step, "loss": 1.0}) + "\n"
        if len(kept) + len(line) > 4000:
            break
        kept += line
    with open(metrics, "w") as f:
        f.write(kept)
    fill(small_disk)

    log = loop.LossLog(workdir)
    for step in range(100, 200):
        log.add(step, jnp.float32(step))
    fresh = log.flush()  # no exception: metrics are not the checkpoint

    assert sorted(fresh) == list(range(100, 200)) and log.losses == fresh
    assert open(metrics).read() == kept, "a failed append leaves no half line behind"
    warnings = [r.getMessage() for r in caplog.records if "metrics: cannot append" in r.getMessage()]
    assert len(warnings) == 1 and "no space left on device" in warnings[0], warnings


# --- an unreachable gs:// endpoint ------------------------------------------------------------------

@pytest.mark.parametrize("module, flags", [
    ("trainer.inspect", []),
    ("verifier.verify", ["--mesh=data=2", "--once"]),
    ("trainer.train", ["--mesh=data=2", "--batch_size=32", "--steps=10"]),
])
def test_an_unreachable_gcs_endpoint_is_one_line_naming_it_after_the_storage_timeout(module, flags):
    if importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcsfs is not installed (pip install -e .[gcs]); CI installs it")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"TENSORSTORE_GCS_HTTP_URL": url, "STORAGE_EMULATOR_HOST": url, "GOOGLE_CLOUD_PROJECT": "test",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    result = helpers.run_module(module, "--workdir=gs://bucket/run", "--storage_timeout_secs=3", *flags,
                                device_count=2, timeout=120, **env)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line == f"error: --workdir=gs://bucket/run: endpoint {url} unreachable (no answer within 3s)", line
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


# --- a missing workdir ------------------------------------------------------------------------------

READERS = {"inspect": ("trainer.inspect", []), "verify": ("verifier.verify", ["--mesh=data=2", "--once"])}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_missing_workdir_or_a_file_is_refused_by_readers(tmp_path, reader, kind):
    workdir = tmp_path / "run"
    if kind == "file":
        workdir.write_text("not a workdir")
    before = helpers.disk_state(str(tmp_path))
    module, flags = READERS[reader]
    result = helpers.run_module(module, f"--workdir={workdir}", *flags, device_count=2)
    expected = "does not exist" if kind == "missing" else "exists and is not a directory"
    helpers.assert_refused(result, before, f"--workdir={workdir}", expected)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_an_empty_workdir_is_a_run_without_checkpoints(tmp_path, reader):
    before = helpers.snapshot(str(tmp_path))
    module, flags = READERS[reader]
    result = helpers.run_module(module, f"--workdir={tmp_path}", *flags, device_count=2)
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    assert reader != "inspect" or result.stdout.strip() == "no committed checkpoints"
    assert helpers.snapshot(str(tmp_path)) == before, "a reader writes nothing"


def test_a_refused_resume_on_a_missing_workdir_creates_nothing(tmp_path):
    workdir = tmp_path / "parent" / "run"
    before = helpers.disk_state(str(tmp_path), str(workdir))
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--resume_from=999", *SMALL)
    helpers.assert_refused(result, before, "--resume_from=999", "not a committed step")


# --- a committed step that is not whole ----------------------------------------------------------

def _delete_newest_manifest(workdir: str) -> int:
    os.remove(workdir_lib.manifest_file(workdir, 30))
    return 20


def _rename_a_killed_save_to_look_committed(workdir: str) -> int:
    """A killed save's tmp directory (arrays written, no manifest) renamed by hand to a step name."""
    leftover = helpers.checkpoint_dir(workdir, "40")
    state = workdir_lib.STATE_ITEM
    shutil.copytree(os.path.join(helpers.checkpoint_dir(workdir, "30"), state), os.path.join(leftover, state))
    return 30


@pytest.mark.parametrize("damage", [_delete_newest_manifest, _rename_a_killed_save_to_look_committed])
def test_a_step_without_its_manifest_is_set_aside_and_the_resume_falls_back(tmp_path, trained_copy, damage):
    workdir = str(tmp_path / "run")
    trained(trained_copy, workdir, steps=30)
    fallback = damage(workdir)
    damaged = max(committed_steps(workdir))
    before = {s: files for s, files in helpers.committed_snapshot(workdir).items() if s != damaged}
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=50", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint step {damaged} cannot be restored" in result.stderr
    assert f"falling back to step {fallback}" in result.stderr and f"resumed from step {fallback}" in result.stderr
    assert os.listdir(workdir_lib.superseded_dir(workdir))[0].startswith(f"{damaged}-")
    helpers.assert_committed_intact(before, workdir)
    assert committed_steps(workdir)[-1] == 50
