"""The edges a user hits first (issue 21, sections 5 and 6; issue 50; docs/faults.md): Ctrl-C is a
preemption and a second one exits at once, a SIGTERM before any handler is a pod's preemption, help
exits 0, a CPU-only machine is told how to fake devices, a read-only file system is named. Real
processes, real signals, real mounts, a really slow disk (strace).
"""

import contextlib
import errno
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from checkpointing.errors import one_line_cause
from checkpointing._src.workdir import committed_steps, read_manifest
from launch import pod as pod_lib
from runtime import exit_codes
from tests import helpers

pytestmark = pytest.mark.slow

SIGINT_BIT = 1 << (signal.SIGINT - 1)


def blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_ctrl_c_on_a_plain_trainer_saves_and_exits_75_without_a_traceback(tmp_path, workdir, no_job_id):
    log = str(tmp_path / "train.log")
    with helpers.started_module("trainer.train", f"--workdir={workdir}", "--steps=100000", *helpers.SMALL_FLAGS,
                                "--max_to_keep=100", log_path=log) as proc:
        wait_for(lambda: committed_steps(workdir) if os.path.isdir(workdir) else False, 240, "a first commit")
        before = helpers.committed_snapshot(workdir)
        os.kill(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        assert proc.wait(timeout=120) == exit_codes.PREEMPTED, open(log).read()[-3000:]
    text = open(log).read()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "SIGINT: saving at the next step boundary" in text, text[-3000:]  # the signal landed in the loop
    assert text.strip().splitlines()[-1].endswith(f"exiting with {exit_codes.PREEMPTED} so the scheduler requeues "
                                                  "the job"), text[-3000:]
    newest = committed_steps(workdir)[-1]
    assert newest > max(before) and read_manifest(workdir, newest)["reason"] == "preemption"
    helpers.assert_committed_intact(before, workdir)


def trainer_child(pid: int) -> psutil.Process | None:
    """The trainer among `pid`'s children, once its shell has exec'd it (strace forks probes of its own)."""
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            if "trainer.train" in child.cmdline():
                return child
    return None


@contextlib.contextmanager
def trainer_on_a_slow_disk(log_path: str, *flags: str):
    """A trainer whose every rename takes a second (strace delays the syscall: a slow file system, for
    real), so each commit (three renames: the manifest's, the state's, the step's) stays in flight for
    seconds. Yields (strace's process, the trainer's pid); both are killed by PID on the way out.
    (A delay on fsync, which each commit calls for every file, crashed strace 6.1 now and then.)"""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace); CI installs it")
    # The trainer's output goes to `log_path` by its own shell redirection: strace's own lines stay out of it.
    command = f"exec {shlex.join([sys.executable, '-m', 'trainer.train', *flags])} >{shlex.quote(log_path)} 2>&1"
    with open(log_path + ".strace", "w") as own_lines:
        tracer = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=rename,renameat,renameat2",
             "-e", "inject=rename,renameat,renameat2:delay_enter=1000000", "/bin/sh", "-c", command],
            env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT, stdout=own_lines, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            wait_for(lambda: tracer.poll() is not None or trainer_child(tracer.pid), 60, "the trainer")
            yield tracer, trainer_child(tracer.pid).pid
        finally:
            for child in (psutil.Process(tracer.pid).children() if tracer.poll() is None else []):
                child.kill()
            if tracer.poll() is None:
                tracer.kill()
            tracer.wait(timeout=30)


def test_a_second_ctrl_c_exits_130_at_once_and_the_save_in_flight_never_commits(tmp_path, workdir, no_job_id):
    log = str(tmp_path / "train.log")
    flags = [f"--workdir={workdir}", *helpers.SMALL_FLAGS, "--max_to_keep=100"]
    with trainer_on_a_slow_disk(log, *flags, "--steps=100000") as (tracer, pid):
        wait_for(lambda: committed_steps(workdir) if os.path.isdir(workdir) else False, 240, "a first commit")
        before = helpers.committed_snapshot(workdir)
        os.kill(pid, signal.SIGINT)
        handed_off = re.compile(r"checkpoint: step (\d+) \(preemption\) handed off")
        wait_for(lambda: handed_off.search(open(log).read()), 240, "the preemption save's hand-off")
        saving = int(handed_off.search(open(log).read())[1])
        os.kill(pid, signal.SIGINT)  # while that save is written: its commit takes three renames, 1 s each
        assert tracer.wait(timeout=60) == exit_codes.INTERRUPTED, open(log).read()[-3000:]
    lines = open(log).read().strip().splitlines()
    latest = committed_steps(workdir)[-1]
    assert lines[-1] == (f"error: second interrupt: exiting now without waiting for the checkpoint of step {saving}; "
                         f"the latest committed step is {latest}"), lines[-5:]
    assert "Traceback" not in "\n".join(lines), lines[-30:]
    # It did not wait: the save it was writing never committed, and its temporary directory is still there.
    assert latest < saving and os.path.isdir(helpers.checkpoint_dir(workdir, f"{saving}.orbax-checkpoint-tmp"))
    helpers.assert_committed_intact(before, workdir)

    at_exit = helpers.committed_snapshot(workdir)
    resumed = helpers.run_module("trainer.train", *flags, f"--steps={latest + 5}")
    assert resumed.returncode == exit_codes.OK, resumed.stderr[-3000:]
    assert f"resumed from step {latest}" in resumed.stderr, resumed.stderr[-3000:]
    assert committed_steps(workdir)[-1] == latest + 5
    assert not os.path.exists(helpers.checkpoint_dir(workdir, f"{saving}.orbax-checkpoint-tmp"))
    helpers.assert_committed_intact(at_exit, workdir)


def test_ctrl_c_during_start_up_is_a_preemption_with_nothing_to_save(tmp_path, workdir, no_job_id):
    log = str(tmp_path / "train.log")
    with helpers.started_module("trainer.train", f"--workdir={workdir}", "--steps=20", *helpers.SMALL_FLAGS,
                                log_path=log) as proc:
        # The start-up guard blocks SIGINT (and SIGTERM) before JAX is imported: send it once it does.
        wait_for(lambda: proc.poll() is not None or blocked_signals(proc.pid) & SIGINT_BIT, 60, "the start-up guard")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == exit_codes.PREEMPTED, open(log).read()[-3000:]
    lines = open(log).read().strip().splitlines()
    assert "Traceback" not in "\n".join(lines), lines[-30:]
    assert lines[-1].startswith("preempted before start-up (SIGINT before the distributed runtime started): nothing "
                                "to save; exiting 75"), lines[-5:]
    assert not committed_steps(workdir) if os.path.isdir(workdir) else True


def test_a_sigterm_before_any_handler_preempts_the_pod_at_once(tmp_path, workdir, no_job_id):
    """Process 0 is sent SIGTERM (from outside the launcher) right after it is started, before its
    interpreter can install anything: it dies of the default action. The launcher counts that as a
    preemption, forwards SIGTERM to its peer at once (which is waiting for process 0 at start-up)
    and the pod exits 75, well within the 30 s grace."""
    output = io.StringIO()
    pod, pumps = pod_lib.start_pod("trainer.train", [f"--workdir={workdir}", "--steps=20", *helpers.SMALL_FLAGS],
                                   2, 4, output=output)
    try:
        os.kill(pod.pids[0], signal.SIGTERM)
        started = time.monotonic()
        code = pod_lib.wait_pod(pod, peer_exit_grace_secs=30)
        elapsed = time.monotonic() - started
    finally:
        for proc in pod.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for pump in pumps:
            pump.join(timeout=5)
    codes = [proc.returncode for proc in pod.processes]
    assert codes[0] == -signal.SIGTERM, f"the SIGTERM did not land before a handler: {codes}\n{output.getvalue()}"
    assert codes[1] in (exit_codes.PREEMPTED, -signal.SIGTERM), f"{codes}\n{output.getvalue()[-3000:]}"
    assert code == exit_codes.PREEMPTED and elapsed < 20, (code, elapsed, output.getvalue()[-3000:])
    assert not os.path.isdir(workdir) or not committed_steps(workdir)


@pytest.mark.parametrize("module", ["trainer.train", "verifier.verify", "trainer.inspect", "launch.local",
                                    "launch.demo", "launch.tpu.recipe", "launch.gke.manifest"])
@pytest.mark.parametrize("flag", ["--helpfull", "--help"])
def test_help_exits_0_for_every_entry_point(module, flag):
    result = helpers.run_module(module, flag)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--" in result.stdout and "Traceback" not in result.stderr, result.stdout[-1000:] + result.stderr[-2000:]


def test_the_readme_mesh_on_one_cpu_device_says_how_to_fake_devices(tmp_path):
    workdir = str(tmp_path / "run")
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=4,model=2", device_count=1)
    helpers.assert_refused(result, before, "error: --mesh=data=4,model=2 has 8 devices but 1 are visible",
                           "XLA_FLAGS=--xla_force_host_platform_device_count=8")


@pytest.fixture
def read_only_disk(tmp_path):
    """A real file system (tmpfs) holding a trained run, remounted read-only; unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({result.stderr.strip()}); CI runs as root")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_read_only_file_system_is_named_as_such(trained_copy, read_only_disk, no_job_id):
    """The verifier writes only verdicts: on a workdir whose disk is read-only (ext4's errors=remount-ro
    does this to a failing disk) its first verdict write fails with EROFS, named as such."""
    workdir = os.path.join(read_only_disk, "run")
    trained_copy(workdir, **helpers.SHARED_RUN, steps=10)
    subprocess.run(["mount", "-o", "remount,ro", read_only_disk], check=True)
    before = helpers.committed_snapshot(workdir)
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith("error: verdict of step 10: cannot write "), line
    assert line.endswith(": read-only file system"), line
    helpers.assert_committed_intact(before, workdir)
    assert one_line_cause(OSError(errno.EROFS, os.strerror(errno.EROFS), workdir)) == "read-only file system"
