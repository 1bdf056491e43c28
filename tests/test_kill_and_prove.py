"""Kill it and prove it (seed 003): SIGKILL at random moments, mid-save included, then resume.

A run killed and restarted with the same command must record the same per-step loss list as an
uninterrupted run, bit for bit, and end in the same state, leaf for leaf.
"""

import os
import random
import signal
import time

import pytest

from checkpointing.report import recorded_losses
from checkpointing.service import committed_steps
from tests import helpers
from trainer import checkpoints
from trainer.config import TrainConfig, validate
from trainer.program import build_mesh, build_program

STEPS = 40
TRAIN_FLAGS = ["--mesh=data=4,model=2", f"--steps={STEPS}", "--save_every_steps=5", "--max_to_keep=100",
               "--batch_size=32", "--hidden_dim=512", "--num_layers=3", "--log_every_steps=5"]
TMP_MARKER = ".orbax-checkpoint-tmp"


def temporary_dirs(workdir: str) -> list[str]:
    directory = helpers.checkpoint_dir(workdir)
    return [name for name in os.listdir(directory) if TMP_MARKER in name] if os.path.isdir(directory) else []


def kill_when(workdir: str, log_path: str, should_kill, timeout: float = 240) -> bool:
    """Starts the trainer and SIGKILLs it the moment `should_kill()` is true; False if it finished first."""
    with helpers.started_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS, log_path=log_path) as proc:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if should_kill():
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return True
            time.sleep(0.001)
        assert proc.poll() is not None, "trainer did not finish in time"
        assert proc.returncode == 0, open(log_path).read()[-3000:]
        return False


def final_state(workdir: str):
    config = validate(TrainConfig(workdir=workdir, mesh=helpers.MESHES["data=4,model=2"], batch_size=32,
                                  hidden_dim=512, num_layers=3), 8)
    program = build_program(config, build_mesh(config))
    return checkpoints.open_service(config, program).restore(STEPS, program.abstract_state).state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["mid_save", "random"])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, uninterrupted, plan):
    workdir = str(tmp_path / "run")
    rng = random.Random(20261130)
    kills = 0
    for attempt in range(3):
        log_path = str(tmp_path / f"attempt{attempt}.log")
        if plan == "mid_save":
            # Kill while an async save is being written: its temporary directory exists.
            should_kill = lambda: bool(temporary_dirs(workdir))
        else:
            start, delay = time.monotonic(), rng.uniform(0.2, 2.5)
            should_kill = lambda start=start, delay=delay: (
                bool(committed_steps(workdir)) and time.monotonic() - start > delay)
        before = committed_steps(workdir)
        if not kill_when(workdir, log_path, should_kill):
            break
        kills += 1
        if plan == "mid_save":
            (leftover,) = temporary_dirs(workdir)
            killed_step = int(leftover.split(".")[0])
            assert killed_step not in committed_steps(workdir), "a half-written step must never be listed"
        assert set(before) <= set(committed_steps(workdir))
    else:
        result = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS)
        assert result.returncode == 0, result.stderr[-3000:]
    assert kills >= 1, "the run finished before any kill point was reached"
    assert committed_steps(workdir)[-1] == STEPS
    assert not temporary_dirs(workdir), "leftover temporary directories are cleaned at start-up"

    resumed, expected = recorded_losses(workdir), recorded_losses(uninterrupted)
    assert list(expected) == list(range(STEPS))
    assert resumed == expected  # the whole list, bit for bit
    assert helpers.leaves_equal(final_state(workdir), final_state(uninterrupted))
