"""A reader's damaged file never stops the writer (issue 21, section 2; docs/faults.md).

A verdict cut in half (what a power loss can leave) is a warning and counts as unproved: the
trainer saves on, `inspect` shows it as damaged and the verifier writes it again. Real processes
on a real workdir.
"""

import json

import pytest

from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from tests import helpers
from tests.tamper import RUN

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]


def cut_in_half(workdir: str, step: int) -> None:
    path = workdir_lib.verdict_file(workdir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    whole = verdicts.make(step=step, level="reproduced", status="pass", detail=f"step {step}: reproduced",
                          checkpoint_mesh={"data": 4, "model": 2}, verifier_mesh={"data": 2}, durations_secs={})
    text = json.dumps(whole, indent=1)
    path.write_text(text[: len(text) // 2])


def test_a_verdict_cut_in_half_warns_once_and_the_trainer_inspect_and_verifier_go_on(trained_copy, workdir,
                                                                                    no_job_id):
    trained_copy(workdir, **RUN)  # commits 10, 20, 30
    cut_in_half(workdir, 30)
    before = helpers.committed_snapshot(workdir)

    trained = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=50", *TRAIN)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "Traceback" not in trained.stderr, trained.stderr[-3000:]
    warned = [line for line in trained.stderr.splitlines() if "verdict of step 30 is damaged" in line]
    assert len(warned) == 1, trained.stderr[-3000:]
    assert "not valid JSON" in warned[0] and "counts as unproved" in warned[0], warned[0]
    helpers.assert_committed_intact(before, workdir)
    assert committed_steps(workdir) == [10, 20, 30, 40, 50]

    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    assert table.returncode == 0, table.stderr[-3000:]
    row = next(line for line in table.stdout.splitlines() if line.split()[0] == "30")
    assert row.rstrip().endswith("damaged (unproved)"), table.stdout

    verified = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                  device_count=2)
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert verdicts.load(workdir, 30)[1] is None, "the verifier did not write the damaged verdict again"
    assert verdicts.is_proved(verdicts.read(workdir, 30))
    assert verdicts.proved_steps(workdir, committed_steps(workdir)) == [10, 20, 30, 40, 50]
    helpers.assert_committed_intact(before, workdir)
