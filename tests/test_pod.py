"""Multi-host pods on 127.0.0.1: the real JAX distributed runtime, gloo collectives, real signals."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime import exit_codes
from launch.pod import pod_exit_code
from tests import helpers
from trainer import models

pytestmark = pytest.mark.slow

STEPS = 120  # long enough that a signal after the first checkpoint lands mid-run
RESUMED_STEPS = 30
TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]


def pod_command(num_processes, devices_per_process, *flags, grace=10):
    return [sys.executable, "-m", "launch.local", f"--num_processes={num_processes}",
            f"--devices_per_process={devices_per_process}", f"--peer_exit_grace_secs={grace}", "--", *flags]


def run_pod(num_processes, devices_per_process, *flags, timeout=300):
    result = subprocess.run(pod_command(num_processes, devices_per_process, *flags), env=helpers.subprocess_env(),
                            cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    return result


def trainer_pids(launcher: subprocess.Popen, expected: int, timeout: float = 60) -> list[int]:
    """The launcher's children ordered by --process_id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(launcher.pid).children()
        if len(children) == expected:
            by_id = {next(a for a in c.cmdline() if a.startswith("--process_id=")): c.pid for c in children}
            return [by_id[f"--process_id={i}"] for i in range(expected)]
        time.sleep(0.1)
    raise AssertionError("pod processes did not start")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: an uninterrupted 2 x 4 pod on data=4,model=2, STEPS steps."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    result = run_pod(2, 4, f"--workdir={workdir}", f"--steps={STEPS}", *TRAIN)
    assert result.returncode == 0, result.stdout[-3000:]
    return recorded_losses(workdir)


def test_pod_exit_code_rules():
    assert pod_exit_code([0, 0]) == exit_codes.OK
    assert pod_exit_code([75, 0]) == exit_codes.PREEMPTED
    assert pod_exit_code([75, -9]) == exit_codes.FAILURE
    assert pod_exit_code([2, 1]) == exit_codes.BAD_INPUT


def test_two_process_save_restores_on_one_and_on_four_processes(tmp_path, uninterrupted):
    saved = str(tmp_path / "saved")
    result = run_pod(2, 4, f"--workdir={saved}", "--steps=20", *TRAIN)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] " in result.stdout and "[1] " in result.stdout, "output is prefixed with the process id"
    pod_losses = recorded_losses(saved)
    assert pod_losses == {s: uninterrupted[s] for s in range(20)}, "the same mesh and processes: bit-exact"

    one = str(tmp_path / "one")
    shutil.copytree(saved, one)
    result = helpers.run_module("trainer.train", f"--workdir={one}", f"--steps={RESUMED_STEPS}", *TRAIN[1:],
                                "--mesh=data=8")
    assert result.returncode == 0, result.stderr[-3000:]
    four = str(tmp_path / "four")
    shutil.copytree(saved, four)
    result = run_pod(4, 2, f"--workdir={four}", f"--steps={RESUMED_STEPS}", *TRAIN[1:], "--mesh=data=8")
    assert result.returncode == 0, result.stdout[-3000:]
    for workdir in (one, four):  # each restore checked every fingerprint; then the losses
        resumed = recorded_losses(workdir)
        assert {s: resumed[s] for s in range(20)} == pod_losses
        tail = {s: resumed[s] for s in range(20, RESUMED_STEPS)}
        assert helpers.max_relative_difference(tail, {s: uninterrupted[s] for s in range(20, RESUMED_STEPS)}) \
            <= models.resolve("mlp").cross_mesh_loss_rtol
    # gloo adds across processes in another order than one process does: close, not bit-equal.
    rtol = models.resolve("mlp").cross_mesh_loss_rtol
    assert helpers.max_relative_difference(recorded_losses(one), recorded_losses(four)) <= rtol


def test_time_based_saves_are_decided_once_for_every_process(tmp_path, uninterrupted):
    # Process 0's clock decides and a broadcast carries it (and the next step to ask) to every
    # process: a host that saved alone would hang in Orbax's barriers, and the run would not end.
    # --save_every_secs=auto decides through the same path.
    workdir = str(tmp_path / "timed")
    result = run_pod(2, 4, f"--workdir={workdir}", "--steps=60", *TRAIN[:2], "--max_to_keep=100",
                     "--save_every_secs=0.5")
    assert result.returncode == 0, result.stdout[-3000:]
    reasons = {step: read_manifest(workdir, step)["reason"] for step in committed_steps(workdir)}
    assert list(reasons.values()).count("time") >= 2 and reasons[60] == "final", reasons
    assert recorded_losses(workdir) == {s: uninterrupted[s] for s in range(60)}, "saves never change the run"


def test_sigterm_to_one_process_saves_the_same_step_everywhere_and_requeues(tmp_path, uninterrupted):
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", f"--steps={STEPS}", *TRAIN]
    log = open(tmp_path / "pod.log", "w")
    launcher = subprocess.Popen(pod_command(2, 4, *flags), env=helpers.subprocess_env(),
                                cwd=helpers.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        pids = trainer_pids(launcher, 2)
        wait_for(lambda: 10 in committed_steps(workdir), 120, "the first checkpoint")
        os.kill(pids[1], signal.SIGTERM)
        assert launcher.wait(timeout=120) == exit_codes.PREEMPTED
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    text = open(tmp_path / "pod.log").read()
    preempted = sorted({line.split("preempted at step ")[1].split(";")[0] for line in text.splitlines()
                        if "preempted at step" in line})
    assert len(preempted) == 1, f"both processes must agree on one step: {preempted}"
    step = int(preempted[0])
    assert text.count(f"preempted at step {step}") == 2
    assert committed_steps(workdir)[-1] == step
    result = run_pod(2, 4, *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    assert recorded_losses(workdir) == uninterrupted


def test_sigkill_of_one_process_ends_the_pod_in_bounded_time_and_a_restart_resumes(tmp_path, uninterrupted):
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", "--steps=100000", *TRAIN, "--watchdog_secs=20",
             "--heartbeat_timeout_secs=10"]
    launcher = subprocess.Popen(pod_command(2, 4, *flags, grace=5), env=helpers.subprocess_env(),
                                cwd=helpers.REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = trainer_pids(launcher, 2)
        wait_for(lambda: 20 in committed_steps(workdir), 120, "two checkpoints")
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        code = launcher.wait(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == exit_codes.PREEMPTED  # a lost process is a requeue (launch/pod.py)
    assert elapsed < 20 + 5 + 15, f"the survivor took {elapsed:.0f}s to exit"
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
    last = committed_steps(workdir)[-1]
    result = run_pod(2, 4, f"--workdir={workdir}", f"--steps={last + 10}", *TRAIN)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {last}" in result.stdout


def test_a_stopped_peer_during_a_save_becomes_a_failure_exit_within_the_watchdog_bound(tmp_path):
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", "--steps=100000", *TRAIN[:2], "--save_every_steps=5", "--max_to_keep=3",
             "--hidden_dim=512", "--num_layers=3", "--watchdog_secs=15"]
    launcher = subprocess.Popen(pod_command(2, 4, *flags, grace=5), env=helpers.subprocess_env(),
                                cwd=helpers.REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stopped = None
    try:
        pids = trainer_pids(launcher, 2)
        wait_for(lambda: committed_steps(workdir), 120, "the first checkpoint")
        wait_for(lambda: any(".orbax-checkpoint-tmp" in n for n in os.listdir(helpers.checkpoint_dir(workdir))), 120,
                 "a save in flight")
        os.kill(pids[1], signal.SIGSTOP)
        stopped = pids[1]
        stopped_at = time.monotonic()
        code = launcher.wait(timeout=120)
        elapsed = time.monotonic() - stopped_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if stopped and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
    assert code == exit_codes.FAILURE
    assert 5 < elapsed < 15 + 5 + 15, f"pod exit took {elapsed:.0f}s after the peer stopped"


def test_the_demo_resumes_from_the_local_tier_then_on_another_layout_and_proves_it(tmp_path):
    """The README's main command, as a user runs it from a directory of their own with a relative
    DEMO_WORKDIR (shortened to 100 steps)."""
    result = subprocess.run(["bash", os.path.join(helpers.REPO_ROOT, "launch", "demo.sh"), "--steps=100",
                             "--save_every_steps=10"], env=helpers.subprocess_env(DEMO_WORKDIR="my demo"),
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert os.listdir(tmp_path) == ["my demo"]
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["step", "committed", "resumed_from", "verdict"]
    assert any("preemption, 2 processes" in line for line in lines)
    assert any("(local)" in line for line in lines), "the crashed job resumed from its local tier"
    assert any("4 processes" in line and "(persistent)" in line for line in lines)
    assert any("4 processes, data=8" in line for line in lines)
    assert all(line.endswith(" pass") for line in lines[1:-2]), lines
    assert lines[-2].startswith("RESULT: the resumed loss list equals the uninterrupted run's")
    assert lines[-1].startswith("PICTURE: ")
    picture = lines[-1][len("PICTURE: "):].rsplit(" (loss against step", 1)[0]
    assert os.path.dirname(picture) == str(tmp_path / "my demo")
    assert open(picture, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_sigterm_after_start_up_but_before_a_resumed_runs_first_step_still_preempts(tmp_path, trained_copy):
    """The runtime's safe step is one past the largest id any process has asked about (none yet: 0).
    A resumed run whose first decision is its training step (21 here) never reached that point and
    trained on to the end; decisions are now numbered within the run, so the signal is honoured."""
    workdir = str(tmp_path / "run")
    trained_copy(workdir, **helpers.SHARED_RUN, steps=20)  # commits 10 and 20
    log_path = tmp_path / "pod.log"
    flags = [f"--workdir={workdir}", "--steps=200", *TRAIN]
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(pod_command(2, 4, *flags), env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT,
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            pids = trainer_pids(launcher, 2)
            wait_for(lambda: "phase compile" in open(log_path).read(), 120, "the resumed run's compile")
            assert not re.search(r"\] step \d+ loss ", open(log_path).read()), \
                "the signal must land before training resumes (no progress line yet)"
            os.kill(pids[1], signal.SIGTERM)
            assert launcher.wait(timeout=120) == exit_codes.PREEMPTED, open(log_path).read()[-3000:]
        finally:
            if launcher.poll() is None:
                launcher.kill()
    from checkpointing._src.workdir import read_manifest
    newest = committed_steps(workdir)[-1]
    assert 20 < newest < 200 and read_manifest(workdir, newest)["reason"] == "preemption"
