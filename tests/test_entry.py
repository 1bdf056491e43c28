"""runtime/entry.py: the one exit-code mapping every entry point runs under, in this process.

Each case is a tiny `main` that raises one kind of error; helpers.run_in_process runs it the way
`entry.run` does (flags parsed first) and catches the SystemExit.
"""

import errno

import pytest

from checkpointing.errors import (AsyncSaveError, BadCheckpointRequest, CheckpointError, ConfigMismatchError,
                                  WorkdirLeasedError)
from checkpointing.config import ConfigError
from runtime import entry, exit_codes
from tests import helpers


def raising(error: BaseException):
    def main(argv):
        raise error
    return main


@pytest.mark.parametrize("error, line", [
    (ValueError("--steps must be >= 1, got 0"), "error: --steps must be >= 1, got 0"),
    (ConfigError("--mesh=data=3 has 3 devices but 8 are visible"), "error: --mesh=data=3 has 3 devices"),
    (BadCheckpointRequest("--resume_from=15: not a committed step"), "error: --resume_from=15: not a committed"),
    (ConfigMismatchError("hidden_dim: checkpoint 64 vs this run 128"), "error: hidden_dim: checkpoint 64"),
    (WorkdirLeasedError("/w is leased to another writer"), "error: /w is leased to another writer"),
])
def test_bad_input_is_exit_2_and_one_line(error, line):
    result = helpers.run_in_process(raising(error))
    assert helpers.assert_refused(result, helpers.disk_state()).startswith(line)


@pytest.mark.parametrize("error, line", [
    (CheckpointError("step 30: the manifest is gone"), "error: step 30: the manifest is gone"),
    (AsyncSaveError("background save of step 10 failed"), "error: background save of step 10 failed"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl"),
     "error: /runs/a/metrics.jsonl: no space left on device"),
    (OSError(errno.EIO, "Input/output error"), "error: storage: input/output error"),
])
def test_faults_are_exit_1_and_one_line_last_on_stderr(error, line):
    result = helpers.run_in_process(raising(error))
    assert result.returncode == exit_codes.FAILURE
    assert result.stderr.splitlines() == [line], result.stderr


def test_preempted_is_75_and_no_error_line():
    result = helpers.run_in_process(raising(exit_codes.Preempted(12)))
    assert result.returncode == exit_codes.PREEMPTED == 75
    assert "error:" not in result.stderr


def test_a_main_that_returns_sets_the_code():
    assert helpers.run_in_process(lambda argv: None).returncode == exit_codes.OK
    assert helpers.run_in_process(lambda argv: exit_codes.FAILURE).returncode == exit_codes.FAILURE


def test_a_deliberate_system_exit_passes_through():
    result = helpers.run_in_process(raising(SystemExit(exit_codes.PREEMPTED)))
    assert result.returncode == exit_codes.PREEMPTED and result.stderr == ""


def test_positional_arguments_are_bad_input_unless_the_entry_point_takes_them():
    result = helpers.run_in_process(lambda argv: None, "stray")
    assert helpers.assert_refused(result, helpers.disk_state()) == "error: unexpected arguments: stray"
    seen = []
    assert entry.exit_code_of(lambda argv: seen.append(argv), ["launcher", "python", "-m", "x"],
                              takes_arguments=True) == exit_codes.OK
    assert seen == [["launcher", "python", "-m", "x"]]


def test_an_unknown_flag_is_exit_2_with_absls_message_on_one_line():
    result = helpers.run_in_process(lambda argv: None, "--no_such_flag=1")
    assert "no_such_flag" in helpers.assert_refused(result, helpers.disk_state())


def test_an_unexpected_error_is_not_mapped():
    """A bug keeps its traceback (Python's own exit 1): the mapping hides nothing it does not know."""
    with pytest.raises(RuntimeError, match="a bug"):
        helpers.run_in_process(raising(RuntimeError("a bug")))
