"""The fault matrix for pods (docs/faults.md): a SIGTERM before start-up, a peer that never
arrives, a peer killed mid-run. Real pods of real processes on 127.0.0.1, real signals; each
outcome is the documented exit code, one line, and nothing committed lost.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from checkpointing._src.workdir import committed_steps
from launch.pod import free_port
from runtime import exit_codes
from tests import helpers

pytestmark = pytest.mark.slow

SMALL = helpers.SMALL_FLAGS  # helpers.small_config's run, from the command line


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


def test_a_write_that_fails_on_one_process_only_ends_the_pod_with_that_processs_line(tmp_path):
    """Process 1 may not write files over 8 KiB (tests/write_limited_train.py: RLIMIT_FSIZE), so its shards of
    step 10 fail (EFBIG) while process 0's are written: a full or failing disk on one host. That process names
    the step, its path and the cause at the next step and exits; the runtime then ends the other
    (--heartbeat_timeout_secs). Before, both waited at Orbax's cross-process barrier, which the failed write never
    reaches, until the watchdog (10 minutes), whose line named no disk."""
    workdir = str(tmp_path / "run")
    env = helpers.subprocess_env(4, WRITE_LIMITED_PROCESS="1", WRITE_LIMIT_BYTES="8192")
    command = pod_command(f"--workdir={workdir}", "--steps=40", *SMALL, "--compilation_cache_dir=",
                          "--heartbeat_timeout_secs=5")
    command.insert(command.index("--"), "--module=tests.write_limited_train")
    launcher = subprocess.Popen(command, env=env, cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=300)  # the watchdog's 600 s would end the old hang
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    codes = pod_process_codes(err)
    assert launcher.returncode == exit_codes.FAILURE and codes[1] == exit_codes.FAILURE, (codes, err[-3000:])
    (line,) = [line for line in (out + err).splitlines() if line.startswith("[1] error: ")]
    assert line.startswith("[1] error: background save of step 10 failed: "), line
    assert "ocdbt.process_1" in line and line.endswith(
        f"(writing {workdir}/checkpoints/10); the latest committed step is still None"), line
    assert "did not finish in time" not in out + err  # not ended by the watchdog
    assert committed_steps(workdir) == []
