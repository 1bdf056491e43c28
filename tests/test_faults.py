"""The fault matrix (issue 9, section 3; docs/faults.md): each fault is survived, or refused with one
clear line, and nothing committed is lost. Real parts: a real full disk (a small tmpfs), a closed
port for an unreachable gs:// endpoint, real pods with real signals.

Each test asserts the exit code, the last line of stderr (it names the step, the path or the
endpoint, and the cause) and that every committed step is still there with the same bytes.
"""

import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import psutil
import pytest

from checkpointing import workdir as workdir_lib
from checkpointing.service import committed_steps
from runtime import exit_codes
from launch.pod import free_port
from tests import helpers
from trainer import loop

pytestmark = pytest.mark.slow

# The flags of helpers.small_config, for the same run from the command line.
SMALL = ["--mesh=data=4,model=2", "--batch_size=32", "--log_every_steps=5", "--save_every_steps=10"]


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


def trained(workdir: str, steps: int = 20) -> dict[int, dict[str, str]]:
    """Trains helpers.small_config in this process (saves every 10 steps); returns the committed snapshot."""
    loop.train(helpers.small_config(workdir, steps=steps, save_every_steps=10))
    assert committed_steps(workdir) == list(range(10, steps + 1, 10))
    return helpers.committed_snapshot(workdir)


def test_disk_full_fails_the_save_in_one_line_naming_the_step_and_a_resume_works_once_space_is_freed(small_disk):
    workdir = os.path.join(small_disk, "run")
    before = trained(workdir)
    # Room for the lease and the metrics, not for a checkpoint (about 260 KiB).
    filler = fill(small_disk, leave_bytes=96 * 1024)
    command = ["trainer.train", f"--workdir={workdir}", "--steps=40", *SMALL]

    result = helpers.run_module(*command)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith("error: background save of step 30 failed: no space left on device"), line
    assert f"{workdir}/checkpoints/30" in line and "the latest committed step is still 20" in line, line
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


def test_disk_full_verdict_write_is_one_line_and_leaves_no_tmp_file(small_disk):
    workdir = os.path.join(small_disk, "run")
    before = trained(workdir, steps=10)
    os.makedirs(os.path.join(workdir, workdir_lib.VERDICTS_DIR), exist_ok=True)
    fill(small_disk)

    result = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                "--replay_steps=0", device_count=2)
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
    ("trainer.verify", ["--mesh=data=2", "--once"]),
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

READERS = {"inspect": ("trainer.inspect", []), "verify": ("trainer.verify", ["--mesh=data=2", "--once"])}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_missing_workdir_or_a_file_is_refused_by_readers(tmp_path, reader, kind):
    workdir = tmp_path / "run"
    if kind == "file":
        workdir.write_text("not a workdir")
    before = helpers.snapshot(str(tmp_path))
    module, flags = READERS[reader]
    result = helpers.run_module(module, f"--workdir={workdir}", *flags, device_count=2)
    expected = "does not exist" if kind == "missing" else "exists and is not a directory"
    helpers.assert_refused(result, before, str(tmp_path), f"--workdir={workdir}", expected)


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
    before = helpers.snapshot(str(tmp_path))
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--resume_from=999", *SMALL)
    helpers.assert_refused(result, before, str(tmp_path), "--resume_from=999", "not a committed step")


# --- pods: early preemption, a peer that never arrives, a peer that dies ---------------------------

def pod_command(*flags, grace: float = 60) -> list[str]:
    return [sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=4",
            f"--peer_exit_grace_secs={grace}", "--", *flags]


def pod_process_codes(launcher_stderr: str) -> list[int]:
    """The processes' own exit codes, from the launcher's last log line."""
    match = re.findall(r"pod exit codes \[([-\d, ]+)\] ->", launcher_stderr)
    assert match, launcher_stderr[-3000:]
    return [int(code) for code in match[-1].split(",")]


def guarded_or_importing_jax(pid: int) -> bool:
    """Whether the process's main thread holds SIGTERM (the start-up guard is on), or, failing that,
    it has started importing JAX (about a second before the distributed runtime starts)."""
    with open(f"/proc/{pid}/status") as f:
        blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    if blocked & (1 << (signal.SIGTERM - 1)):
        return True
    with open(f"/proc/{pid}/maps") as f:
        return "jaxlib" in f.read()


def test_sigterm_before_distributed_start_up_preempts_the_pod_with_nothing_to_save(tmp_path):
    workdir = str(tmp_path / "run")
    launcher = subprocess.Popen(pod_command(f"--workdir={workdir}", "--steps=20", *SMALL),
                                env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (targets := [c for c in psutil.Process(launcher.pid).children() if "--process_id=1" in c.cmdline()]):
            assert time.monotonic() < deadline, "the pod's processes did not start"
            time.sleep(0.002)
        # Within the first second or so of the process: before JAX is even imported.
        while not guarded_or_importing_jax(targets[0].pid):
            assert time.monotonic() < deadline, "process 1 never got going"
            time.sleep(0.002)
        targets[0].send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    assert launcher.returncode == exit_codes.PREEMPTED, out[-3000:] + err[-3000:]
    # The peer ended on the SIGTERM the launcher forwarded (75 once its guard is on; -15 if it came
    # even earlier, which the launcher counts as preempted), not on a timeout (1) or a kill (-9).
    peer, signalled = pod_process_codes(err)
    assert signalled == exit_codes.PREEMPTED and peer in (exit_codes.PREEMPTED, -signal.SIGTERM), err[-3000:]
    assert "preempted before start-up" in out
    assert committed_steps(workdir) == []


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_peer_that_never_arrives_is_one_line_and_exit_1_after_the_initialization_timeout(tmp_path, process_id):
    address = f"127.0.0.1:{free_port()}"
    before = helpers.snapshot(str(tmp_path))
    result = helpers.run_module("trainer.train", f"--workdir={tmp_path / 'run'}", *SMALL[1:], "--mesh=data=4",
                                f"--coordinator_address={address}", "--num_processes=2",
                                f"--process_id={process_id}", "--initialization_timeout_secs=5", device_count=4,
                                timeout=120)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line == (f"error: process {process_id} of 2: not every process connected to the coordinator at {address} "
                    "within 5s (--initialization_timeout_secs)"), line
    assert "Check failure" not in result.stderr
    assert helpers.snapshot(str(tmp_path)) == before


def test_a_peer_killed_mid_run_requeues_the_pod_and_a_relaunch_resumes_from_the_last_committed_step(tmp_path):
    """The runtime aborts the survivor (-6) once --heartbeat_timeout_secs passes; that cannot be
    intercepted, so the launcher makes a lost process a requeue (75), not a failure."""
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", "--steps=100000", *SMALL, "--max_to_keep=100", "--heartbeat_timeout_secs=5"]
    launcher = subprocess.Popen(pod_command(*flags), env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while 20 not in committed_steps(workdir):
            assert time.monotonic() < deadline and launcher.poll() is None, "the pod did not reach step 20"
            time.sleep(0.05)
        (target,) = [c for c in psutil.Process(launcher.pid).children() if "--process_id=1" in c.cmdline()]
        target.kill()
        _, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    assert launcher.returncode == exit_codes.PREEMPTED, err[-3000:]
    assert pod_process_codes(err)[1] == -signal.SIGKILL
    assert "killed by SIGKILL from outside the pod (lost)" in err
    before = helpers.committed_snapshot(workdir)
    last = max(before)

    result = subprocess.run(pod_command(*flags[:1], f"--steps={last + 10}", *flags[2:]), env=helpers.subprocess_env(),
                            cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == exit_codes.OK, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from step {last}" in result.stdout
    helpers.assert_committed_intact(before, workdir)
    assert committed_steps(workdir)[-1] == last + 10


# --- a committed step that is not whole ----------------------------------------------------------

def _delete_newest_manifest(workdir: str) -> int:
    os.remove(os.path.join(helpers.checkpoint_dir(workdir, "30"), "manifest", "metadata"))
    return 20


def _rename_a_killed_save_to_look_committed(workdir: str) -> int:
    """A killed save's tmp directory (arrays written, no manifest) renamed by hand to a step name."""
    leftover = helpers.checkpoint_dir(workdir, "40")
    shutil.copytree(os.path.join(helpers.checkpoint_dir(workdir, "30"), "state"), os.path.join(leftover, "state"))
    return 30


@pytest.mark.parametrize("damage", [_delete_newest_manifest, _rename_a_killed_save_to_look_committed])
def test_a_step_without_its_manifest_is_set_aside_and_the_resume_falls_back(tmp_path, damage):
    workdir = str(tmp_path / "run")
    trained(workdir, steps=30)
    fallback = damage(workdir)
    damaged = max(committed_steps(workdir))
    before = {s: files for s, files in helpers.committed_snapshot(workdir).items() if s != damaged}
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=50", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint step {damaged} cannot be restored" in result.stderr
    assert f"falling back to step {fallback}" in result.stderr and f"resumed from step {fallback}" in result.stderr
    assert os.listdir(os.path.join(workdir, "superseded"))[0].startswith(f"{damaged}-")
    helpers.assert_committed_intact(before, workdir)
    assert committed_steps(workdir)[-1] == 50
