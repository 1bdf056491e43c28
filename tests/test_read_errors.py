"""A read error is not corruption: a step is set aside only on evidence that it is wrong.

EIO is injected for real, by strace, on the array files of committed steps while a trainer resumes:
a transient one is retried and the resume takes the newest step; a lasting one is exit 1 naming the
step, the path and the cause, with nothing set aside and no step trained. Committed steps that are all
damaged (evidence) are exit 1 too, never a silent restart from step 0; --resume_from=none --rollback
is how a user says to start over.
"""

import errno
import json
import os
import re

import pytest

from checkpointing._src import reads
from checkpointing.errors import CorruptCheckpointError, StorageUnavailableError
from checkpointing._src.workdir import committed_steps
from tests import eio, helpers, tamper
from trainer import loop

RUN = {**helpers.SHARED_RUN, "steps": 30}  # commits 10, 20 and 30


class Flaky:
    """A read that fails with `error` its first `failures` calls."""

    def __init__(self, failures: int, error: Exception):
        self.calls, self.failures, self.error = 0, failures, error

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "read"


@pytest.fixture
def no_backoff(monkeypatch):
    monkeypatch.setattr(reads, "FIRST_RETRY_SECS", 0.0)


def test_an_io_error_is_retried_and_a_read_that_then_succeeds_is_returned(no_backoff):
    read = Flaky(reads.READ_ATTEMPTS - 1, OSError(errno.EIO, "Input/output error"))
    assert reads.read_retrying(read, "step 30: reading x") == "read"
    assert read.calls == reads.READ_ATTEMPTS


def test_an_io_error_that_lasts_is_the_storages_fault_naming_the_step_and_the_cause(no_backoff):
    read = Flaky(99, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(StorageUnavailableError, match=r"^step 30: reading x failed 4 times: input/output error; "
                                                      r"nothing was set aside"):
        reads.read_retrying(read, "step 30: reading x")
    assert read.calls == reads.READ_ATTEMPTS


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "No such file or directory", "/w/30/d/x"),
                                   ValueError("DATA_LOSS: Error reading: unexpected end of file")])
def test_damage_is_evidence_at_once_without_retrying(no_backoff, error):
    read = Flaky(99, error)
    with pytest.raises(CorruptCheckpointError, match=r"^step 30: reading x failed: file (missing|truncated)"):
        reads.read_retrying(read, "step 30: reading x")
    assert read.calls == 1


def _resume_under_eio(tmp_path, workdir: str, files: list[str], *, until: str | None = None):
    """The trainer resumed to step 40 while the reads of `files` fail with EIO (tests/eio.py)."""
    return eio.run_under_eio(tmp_path, "trainer.train", [f"--workdir={workdir}", "--steps=40", *helpers.SMALL_FLAGS],
                             files, until=until)


@pytest.mark.slow
def test_a_transient_eio_is_retried_and_the_resume_takes_the_newest_step(tmp_path, trained_copy, trained_runs):
    config = trained_copy(**RUN)
    result, injected = _resume_under_eio(tmp_path, config.workdir, eio.array_files(config.workdir, [10, 20, 30]),
                                         until="attempt 2 of 4")
    assert injected >= 1, "no read was failed: the test proves nothing"
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"step 30: reading its arrays from \S+ failed \(input/output error: .+\); attempt 2 of 4",
                     result.stderr)
    assert "resumed from step 30 (persistent)" in result.stderr
    assert not os.path.exists(os.path.join(config.workdir, "superseded"))
    assert committed_steps(config.workdir) == [10, 20, 30, 40]
    straight = loop.read_metrics(trained_runs(**{**RUN, "steps": 40}))
    assert {s: v for s, v in loop.read_metrics(config.workdir).items() if s >= 30} == \
        {s: v for s, v in straight.items() if s >= 30}


@pytest.mark.slow
def test_a_lasting_eio_is_exit_1_naming_step_path_and_cause_and_nothing_is_set_aside(tmp_path, trained_copy):
    config = trained_copy(**RUN)
    before = helpers.committed_snapshot(config.workdir)
    metrics = open(os.path.join(config.workdir, "metrics.jsonl")).read()
    result, injected = _resume_under_eio(tmp_path, config.workdir, eio.array_files(config.workdir, [10, 20, 30]))
    assert injected >= reads.READ_ATTEMPTS
    line = helpers.fault_line(result, 1)
    path = helpers.checkpoint_dir(config.workdir, "30")
    assert line.startswith(f"error: step 30: reading its arrays from {path} failed 4 times: input/output error: "
                           f"{path}/state/"), line
    assert line.endswith("nothing was set aside (an error of the storage is not evidence against the step: run "
                         "again once it reads)"), line
    assert "falling back" not in result.stderr and "starting from step 0" not in result.stderr
    helpers.assert_committed_intact(before, config.workdir)
    assert committed_steps(config.workdir) == [10, 20, 30]
    assert not os.path.exists(os.path.join(config.workdir, "superseded"))
    assert open(os.path.join(config.workdir, "metrics.jsonl")).read() == metrics  # not one step trained
    again = helpers.run_module("trainer.train", f"--workdir={config.workdir}", "--steps=40", *helpers.SMALL_FLAGS)
    assert again.returncode == 0 and "resumed from step 30 (persistent)" in again.stderr, again.stderr[-3000:]


@pytest.mark.slow
def test_every_committed_step_damaged_is_exit_1_and_a_rollback_to_none_starts_over(trained_copy):
    config = trained_copy(**RUN)
    for step in (10, 20, 30):
        tamper.truncate_data_files(config.workdir, step)
    before = helpers.committed_snapshot(config.workdir)
    result = helpers.run_module("trainer.train", f"--workdir={config.workdir}", "--steps=40", *helpers.SMALL_FLAGS)
    line = helpers.fault_line(result, 1)
    assert line.startswith(f"error: no committed step of {config.workdir} can be restored (step 30: "), line
    assert "step 20: " in line and "step 10: " in line and "file truncated" in line
    assert line.endswith("to start this workdir over from step 0, run with --resume_from=none --rollback (they "
                         "move to superseded/)"), line
    assert helpers.committed_snapshot(config.workdir) == before
    over = helpers.run_module("trainer.train", f"--workdir={config.workdir}", "--steps=20", "--resume_from=none",
                              "--rollback", *helpers.SMALL_FLAGS)
    assert over.returncode == 0, over.stderr[-3000:]
    assert "starting from step 0" in over.stderr
    assert committed_steps(config.workdir) == [10, 20]
    helpers.assert_committed_intact(before, config.workdir)  # moved whole to superseded/, not deleted
    manifest = json.loads(open(os.path.join(helpers.checkpoint_dir(config.workdir, "20"), "manifest",
                                            "metadata")).read())
    assert manifest["step"] == 20
