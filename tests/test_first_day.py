"""The edges a new user hits first: a default that saves, --steps below the run's step, a rollback.
Each asserts the exit code, the one line, and that every committed step is unchanged or moved to
superseded/."""

import os
import signal
import time

import pytest

from checkpointing import CheckpointConfig
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from tests import helpers
from tests.tamper import RUN, verify_in_process

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--max_to_keep=100", "--log_every_steps=10"]


def test_the_default_saves_and_the_start_up_line_says_when(workdir, tmp_path):
    assert CheckpointConfig().validated().save_every_secs == "auto"  # no step cadence given: auto
    assert CheckpointConfig(save_every_steps=10).validated().save_every_secs == 0.0
    log = str(tmp_path / "train.log")
    # No cadence flag at all: the default (auto) saves; its bound is shortened so the test is quick.
    with helpers.started_module("trainer.train", f"--workdir={workdir}", "--steps=1000000", *TRAIN,
                                "--max_save_interval_secs=1", log_path=log) as trainer:
        deadline = time.monotonic() + 120
        while not committed_steps(workdir) and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        saved = committed_steps(workdir)
        os.kill(trainer.pid, signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL, "the kill landed while it trained"
    text = open(log).read()
    assert saved, f"nothing was saved by default:\n{text[-3000:]}"
    assert "first checkpoint within 1s (--save_every_secs=auto" in text, text[-3000:]
    assert read_reason(workdir, saved[0]) == "time"


def read_reason(workdir, step):
    return workdir_lib.read_manifest(workdir, step)["reason"]


def test_steps_below_the_runs_step_is_one_line_and_changes_nothing(workdir, trained_copy):
    trained_copy(workdir, **RUN)
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=20", *TRAIN,
                                "--save_every_steps=10")
    line = helpers.assert_refused(result, before, "--steps=20", "already at step 30", "nothing changed")
    assert line.startswith("error: ")


def test_a_rollback_is_refused_naming_the_flag_and_with_it_moves_newer_steps_and_verdicts_aside(workdir,
                                                                                                trained_copy):
    trained_copy(workdir, **RUN)
    verify_in_process(workdir)
    before_disk = helpers.disk_state(workdir)
    refused = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=30", *TRAIN,
                                 "--save_every_steps=10", "--resume_from=10")
    helpers.assert_refused(refused, before_disk, "--resume_from=10", "newer steps [20, 30]", "--rollback")
    wrong = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=30", *TRAIN, "--rollback")
    helpers.assert_refused(wrong, before_disk, "--rollback needs --resume_from=STEP")
    before = helpers.committed_snapshot(workdir)
    rolled = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=30", *TRAIN,
                                "--save_every_steps=10", "--resume_from=10", "--rollback")
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert "resumed from step 10" in rolled.stderr and "setting aside newer steps [20, 30]" in rolled.stderr
    helpers.assert_committed_intact(before, workdir)
    moved = sorted(os.listdir(workdir_lib.superseded_dir(workdir)))
    assert sorted(name.split("-")[0] for name in moved) == ["20", "20", "30", "30"]
    assert sum(name.endswith(".verdict.json") for name in moved) == 2
    assert committed_steps(workdir) == [10, 20, 30]
    assert verdicts.read(workdir, 20) is None and verdicts.read(workdir, 30) is None  # the new saves are unproved


def test_an_eval_the_model_cannot_run_is_refused_before_anything_is_written(tmp_path):
    """A loss that carries model state (BatchNorm) has no plain eval: refused with the other checks, before the
    workdir, its lease or its run record exist (before: after the Checkpointer had opened)."""
    workdir = str(tmp_path / "run")
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--model=examples.cnn_model:spec",
                                "--eval_every_steps=5", f"--eval_data=records:{tmp_path}/eval-*.array_record")
    helpers.assert_refused(result, before, "--eval_every_steps=5: the model's loss carries model state")
