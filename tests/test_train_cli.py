"""`python -m trainer.train` as a user runs it: it trains, and bad flags exit 2 with one line.

The bad-flag cases run `trainer.train.main` in this process, under the same exit-code mapping
(helpers.run_in_process); one case runs the real command, to prove the two agree.
"""

import pytest

from tests import helpers
from trainer import loop
from trainer import train


@pytest.mark.slow
def test_trainer_runs_and_logs_losses(workdir):
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=4,model=2", "--steps=20",
                                "--log_every_steps=10")
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(loop.read_metrics(workdir)) == list(range(20))
    assert "done: steps 0..20" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--mesh=data=3"], "has 3 devices but 8 are visible"),
    (["--mesh=data=4,pipe=2"], "unknown axis 'pipe'"),
    (["--mesh=data=8", "--batch_size=12"], "not divisible by the data axis"),
    (["--steps=0"], "steps"),
    (["--steps=-3"], "steps"),
    (["--model=rnn"], "model"),
    (["--mesh=data=x"], "positive integer size"),
    (["--stepz=3"], "stepz"),
])
def test_bad_flags_exit_2_with_one_line(workdir, flags, message):
    before = helpers.disk_state(workdir)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", *flags)
    helpers.assert_refused(result, before, message)


@pytest.mark.slow  # a subprocess
def test_the_command_itself_exits_2_with_one_line(workdir):
    """The subprocess smoke test of the cases above: the real entry point, its real stderr."""
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=3")
    helpers.assert_refused(result, before, "error: --mesh=data=3 has 3 devices but 8 are visible")


def test_workdir_that_is_a_file_exits_2(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    before = helpers.disk_state(str(tmp_path))
    result = helpers.run_in_process(train.main, f"--workdir={path}")
    line = helpers.assert_refused(result, before)
    assert line == f"error: --workdir={path} exists and is not a directory"
    assert path.read_text() == "not a directory"


def test_unwritable_workdir_exits_2(tmp_path):
    # Root ignores permission bits, so make the workdir's parent a file: mkdir fails for anyone.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    before = helpers.disk_state(str(tmp_path))
    result = helpers.run_in_process(train.main, f"--workdir={blocker}/run")
    helpers.assert_refused(result, before, "is not writable")
