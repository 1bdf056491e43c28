"""The local checkpoint tier through the trainer, on a 2 x 4 pod on 127.0.0.1 (real processes, signals, disks).

One killed run (SIGKILL of process 1 after a local step committed, before the next persistent one)
is copied into one directory per scenario: a relaunch on the same layout, with one host's local
directory lost, on another layout, and with a damaged local step. Losses are compared with an
uninterrupted run of the same flags: bit for bit on the same layout.
"""

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import time

import pytest
import tensorstore as ts

from checkpointing._src import workdir as workdir_lib
from checkpointing._src.compare import compare_losses
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime import exit_codes
from tests import helpers
from tests.test_pod import pod_command, trainer_pids
from trainer import models
from trainer.loop import read_metrics

pytestmark = pytest.mark.slow

STEPS = 50
PERSISTENT_EVERY = 20
KILL_AFTER_LOCAL = 35  # a local step between the persistent steps 20 and 40
SIGTERM_STEPS = 1000  # the preempted run's --steps (it never gets there)
TRAIN = {"mesh": "data=2,model=4", "batch_size": 32, "steps": STEPS, "save_every_steps": PERSISTENT_EVERY,
         "local_save_every_steps": 5, "local_max_to_keep": 4, "log_every_steps": 5, "max_to_keep": 100}


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's workdir and its local directory template ('{process}': the pod's processes share a disk)."""

    workdir: str
    local: str

    @classmethod
    def under(cls, root) -> "Run":
        return cls(str(root / "run"), str(root / "local-{process}"))

    def local_dir(self, process: int) -> str:
        return workdir_lib.expand_local_dir(self.local, process)

    def flags(self, **overrides) -> list[str]:
        train = {**TRAIN, **overrides}
        return [f"--workdir={self.workdir}", f"--local_dir={self.local}", *(f"--{k}={v}" for k, v in train.items())]

    def copy_to(self, root) -> "Run":
        """The same run under `root`: its workdir and every process's local directory that exists."""
        copy = Run.under(root)
        shutil.copytree(self.workdir, copy.workdir)
        for process in range(2):
            if os.path.isdir(self.local_dir(process)):
                shutil.copytree(self.local_dir(process), copy.local_dir(process))
        return copy

    def complete_local_steps(self) -> list[int]:
        """Local steps committed by both processes of the 2 x 4 pod."""
        return sorted(set(committed_steps(self.local_dir(0))) & set(committed_steps(self.local_dir(1))))


def run_pod(num_processes: int, devices_per_process: int, *flags: str, timeout: float = 300):
    """The launcher in a session of its own; its group is killed (by the launcher's id) if it hangs."""
    launcher = subprocess.Popen(pod_command(num_processes, devices_per_process, *flags), env=helpers.subprocess_env(),
                                cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        stdout, _ = launcher.communicate(timeout=timeout)
    finally:
        end(launcher)
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, "")


def start_pod(log, *flags: str, grace: float = 5) -> subprocess.Popen:
    return subprocess.Popen(pod_command(2, 4, *flags, grace=grace), env=helpers.subprocess_env(),
                            cwd=helpers.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def end(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def newest_logged_step(workdir: str) -> int:
    """The newest step in the metrics file process 0 appends at the log cadence; -1 before the first."""
    try:
        return max(read_metrics(workdir), default=-1)
    except (OSError, ValueError):  # not created yet, or a line being appended
        return -1


def run_losses(workdir: str, steps: int = STEPS) -> dict[int, float]:
    """Every step's loss, from the persistent manifests alone: a persistent save after a local resume
    carries the losses the local manifest recorded since the previous persistent save."""
    losses = recorded_losses(workdir)
    assert sorted(losses) == list(range(steps)), f"losses recorded for steps {sorted(losses)}"
    return losses


def assert_bit_identical(losses: dict[int, float], reference: dict[int, float]) -> None:
    mismatch, _ = compare_losses(losses, reference, 0.0)
    assert mismatch is None, mismatch.detail


def assert_resumed(result, step: int, tier: str, workdir: str, steps: int = STEPS) -> None:
    """Exit 0, the resume's log line, and each later persistent manifest naming the step and tier."""
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"resumed from step {step} ({tier})" in result.stdout, result.stdout[-4000:]
    later = [s for s in committed_steps(workdir) if s > step]
    assert later and later[-1] == steps, later
    for saved in later:
        assert read_manifest(workdir, saved)["extra"].get("resumed_from") == {"step": step, "tier": tier}, saved


def flip_byte_of_largest_chunk(local_dir: str, step: int) -> str:
    """Flips the middle byte of the largest chunk's stored value (found in the OCDBT b-tree of the step's
    state), so the arrays still decode and only the fingerprint can tell. Returns the chunk's key."""
    state = workdir_lib.step_dir(local_dir, step) / workdir_lib.STATE_ITEM
    kvstore = ts.KvStore.open({"driver": "file", "path": str(state) + "/"}).result()
    version = ts.ocdbt.dump(kvstore).result()["versions"][-1]
    assert version["root_height"] == 0, "a small state fits one b-tree node"
    entries = ts.ocdbt.dump(kvstore, version["root"]["location"]).result()["entries"]
    chunks = [(e["key"], e["indirect_value"].removeprefix("value:").split(":")) for e in entries
              if "indirect_value" in e and b"/c/" in e["key"]]
    key, (prefix, data_file, offset, length) = max(chunks, key=lambda chunk: int(chunk[1][3]))
    with open(state / prefix / data_file, "r+b") as f:
        f.seek(int(offset) + int(length) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return key.decode()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 2 x 4 pod with both tiers: every step's loss."""
    run = Run.under(tmp_path_factory.mktemp("reference"))
    result = run_pod(2, 4, *run.flags())
    assert result.returncode == 0, result.stdout[-4000:]
    return run_losses(run.workdir)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Run:
    """A pod whose process 1 was SIGKILLed once local step KILL_AFTER_LOCAL had committed on both processes
    and before persistent step 40 committed (else the scenarios would not test the local tier)."""
    root = tmp_path_factory.mktemp("killed")
    run = Run.under(root)
    with open(root / "pod.log", "w") as log:
        launcher = start_pod(log, *run.flags())
        try:
            pids = trainer_pids(launcher, 2)
            wait_for(lambda: KILL_AFTER_LOCAL in run.complete_local_steps(), 240, f"local step {KILL_AFTER_LOCAL}")
            os.kill(pids[1], signal.SIGKILL)
            code = launcher.wait(timeout=120)
        finally:
            end(launcher)
    assert code != exit_codes.OK, open(root / "pod.log").read()[-4000:]
    assert committed_steps(run.workdir) == [PERSISTENT_EVERY], "the kill landed after persistent step 40"
    assert run.complete_local_steps()[-1] >= KILL_AFTER_LOCAL
    return run


def test_a_killed_pod_resumes_from_its_newest_complete_local_step_bit_for_bit(tmp_path, reference, killed):
    newest = killed.complete_local_steps()[-1]
    run = killed.copy_to(tmp_path)
    result = run_pod(2, 4, *run.flags())
    assert_resumed(result, newest, "local", run.workdir)
    assert_bit_identical(run_losses(run.workdir), reference)
    shown = helpers.run_module("trainer.inspect", f"--workdir={run.workdir}")
    assert shown.returncode == 0, shown.stderr[-3000:]
    rows = [line for line in shown.stdout.splitlines() if line.split()[:1] == [str(STEPS)]]
    assert rows and "local" in rows[0], shown.stdout


def test_a_lost_local_directory_resumes_from_the_persistent_tier_bit_for_bit(tmp_path, reference, killed):
    run = killed.copy_to(tmp_path)
    shutil.rmtree(run.local_dir(1))  # a replaced host: its local disk is empty
    result = run_pod(2, 4, *run.flags())
    assert_resumed(result, PERSISTENT_EVERY, "persistent", run.workdir)
    assert_bit_identical(run_losses(run.workdir), reference)


def test_another_layout_ignores_the_local_tier_and_resumes_within_tolerance(tmp_path, reference, killed):
    run = killed.copy_to(tmp_path)
    result = run_pod(4, 2, *run.flags(mesh="data=8"))
    assert_resumed(result, PERSISTENT_EVERY, "persistent", run.workdir)
    why = [line for line in result.stdout.splitlines() if "local tier" in line and "another layout" in line]
    # One line in each process's log (on a real pod each host has its own).
    assert sorted(line[:4] for line in why) == [f"[{p}] " for p in range(4)], result.stdout[-4000:]
    losses = run_losses(run.workdir)
    assert_bit_identical({s: losses[s] for s in range(PERSISTENT_EVERY)},
                         {s: reference[s] for s in range(PERSISTENT_EVERY)})
    mismatch, largest = compare_losses(losses, reference, models.resolve("mlp").cross_mesh_loss_rtol)
    assert mismatch is None, f"{mismatch.detail}; largest relative difference {largest:g}"


def test_a_damaged_local_step_is_skipped_for_the_next_candidate_bit_for_bit(tmp_path, reference, killed):
    complete = killed.complete_local_steps()
    newest = complete[-1]
    run = killed.copy_to(tmp_path)
    flip_byte_of_largest_chunk(run.local_dir(0), newest)
    result = run_pod(2, 4, *run.flags())
    errors = [line for line in result.stdout.splitlines() if "cannot be restored" in line]
    assert errors and all(f"step {newest}" in line and "fingerprint" in line.lower() for line in errors), \
        result.stdout[-4000:]
    older = [s for s in complete[:-1] if s >= PERSISTENT_EVERY]
    step, tier = (older[-1], "local") if older else (PERSISTENT_EVERY, "persistent")
    assert_resumed(result, step, tier, run.workdir)
    assert_bit_identical(run_losses(run.workdir), reference)


def test_sigterm_commits_a_local_step_exits_75_and_the_resume_uses_it(tmp_path, reference):
    run = Run.under(tmp_path)
    # The local tier only at the preemption. Steps without saves are fast (~40/s), so the run is long
    # enough that the signal always lands mid-run, and the resume ends at STEPS, as the reference did.
    flags = functools.partial(run.flags, local_save_every_steps=0, save_every_steps=100)
    with open(tmp_path / "pod.log", "w") as log:
        launcher = start_pod(log, *flags(steps=SIGTERM_STEPS))
        try:
            trainer_pids(launcher, 2)
            wait_for(lambda: newest_logged_step(run.workdir) >= 15, 240, "step 15")
            os.kill(launcher.pid, signal.SIGTERM)  # the launcher forwards it to every process
            code = launcher.wait(timeout=120)
        finally:
            end(launcher)
    text = open(tmp_path / "pod.log").read()
    assert code == exit_codes.PREEMPTED, text[-4000:]
    preempted = {line.split("preempted at step ")[1].split(";")[0].split()[0] for line in text.splitlines()
                 if "preempted at step" in line}
    assert len(preempted) == 1, f"both processes must agree on one step: {preempted}"
    step = int(preempted.pop())
    assert 15 <= step < SIGTERM_STEPS
    assert [committed_steps(run.local_dir(p)) for p in (0, 1)] == [[step], [step]]
    assert all(s <= step for s in committed_steps(run.workdir)), "a persistent copy, if any, is of the same step"
    end_step = max(STEPS, step + 5)
    result = run_pod(2, 4, *flags(steps=end_step))
    assert_resumed(result, step, "local", run.workdir, end_step)
    assert_bit_identical(run_losses(run.workdir, end_step), reference)
