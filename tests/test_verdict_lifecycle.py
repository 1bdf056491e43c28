"""A verdict's life: a complete verdict is final for its save unless --reverify redoes it; a step that
retention deletes mid-proof ends `gone` wherever the deletion lands, and a pass is never overwritten by a
fail; --resume_from=latest falls back past a step the verifier failed (evidence), as past a corrupt one."""

import glob
import os
import re
import shutil

import pytest

from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from tests import helpers
from tests.tamper import RUN, rewrite_step, swap_adam_moments, truncate_data_files, verify_in_process
from verifier.verifier import Verifier, VerifierOptions

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]


def verify(workdir: str, *flags: str):
    return helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=8", "--once", *flags)


def proved_now(result) -> list[int]:
    """The steps a verifier run wrote a complete verdict for (its log)."""
    return [int(step) for step in re.findall(r"verdict step (\d+): ", result.stderr)]


def test_a_complete_verdict_is_redone_only_with_reverify(workdir, trained_copy, tmp_path):
    trained_copy(workdir, **RUN)
    original = str(tmp_path / "30-arrays")
    shutil.copytree(os.path.join(helpers.checkpoint_dir(workdir, "30"), workdir_lib.STATE_ITEM), original)
    truncate_data_files(workdir, 30)  # a disk that lost step 30's arrays: evidence
    assert [v["status"] for v in verify_in_process(workdir).values()] == ["pass", "pass", "fail"]
    # Restored from a backup: a complete verdict of the same save is not redone by itself...
    shutil.rmtree(os.path.join(helpers.checkpoint_dir(workdir, "30"), workdir_lib.STATE_ITEM))
    shutil.copytree(original, os.path.join(helpers.checkpoint_dir(workdir, "30"), workdir_lib.STATE_ITEM))
    again = verify(workdir)
    assert helpers.fault_line(again, 1).startswith("error: failing verdicts for steps [30] (")
    assert proved_now(again) == []
    # ...only when asked: the chosen steps, once.
    redone = verify(workdir, "--reverify=30")
    assert redone.returncode == 0 and proved_now(redone) == [30], redone.stderr[-3000:]
    assert verdicts.read(workdir, 30)["level"] == "reproduced"
    everything = verify(workdir, "--reverify=all")
    assert everything.returncode == 0 and proved_now(everything) == [10, 20, 30], everything.stderr[-3000:]


@pytest.mark.parametrize("flag, named", [("--reverify=20,x", "--reverify=20,x: give committed step numbers"),
                                         ("--reverify=25", "not committed in ")])
def test_reverify_of_what_is_not_a_committed_step_is_refused(workdir, trained_copy, flag, named):
    trained_copy(workdir, **RUN)
    before = helpers.disk_state(workdir)
    helpers.assert_refused(verify(workdir, flag), before, named)


class DeletesStep20(Verifier):
    """The real verifier; retention deletes step 20 after its intact verdict, before or during its replay."""

    def __init__(self, options, when: str):
        super().__init__(options)
        self.when, self.deleted = when, False

    def _delete_20(self):
        if not self.deleted:
            self.deleted = True
            shutil.rmtree(helpers.checkpoint_dir(self.options.workdir, "20"))

    def _prove(self, step, held, disk_anchor):
        if step == 20 and self.when == "before its replay":
            self._delete_20()
        return super()._prove(step, held, disk_anchor)

    def _replay(self, program, state, start_step, count, batches=None, perturb=None):
        if self._proving == 20 and self.when == "during its replay":
            self._delete_20()
        return super()._replay(program, state, start_step, count, batches, perturb)


@pytest.mark.parametrize("when", ["before its replay", "during its replay"])
def test_a_step_deleted_after_its_intact_proof_ends_gone(workdir, trained_copy, when):
    trained_copy(workdir, **RUN)
    verifier = DeletesStep20(VerifierOptions(workdir=workdir, mesh=(("data", 8),)), when)
    written = {v["step"]: v for v in verifier.verify_pending()}
    assert verifier.deleted and written[20]["status"] == "gone", written[20]
    assert written[20]["detail"].startswith("deleted while being verified"), written[20]["detail"]
    assert [written[s]["status"] for s in (10, 30)] == ["pass", "pass"]
    assert verifier.ledger.exit_line(committed_steps(workdir)) is None


def test_a_pass_is_never_overwritten_by_a_fail_as_a_step_being_deleted_reads(workdir, trained_copy):
    trained_copy(workdir, **RUN)
    proved = verify_in_process(workdir)[20]
    assert proved["level"] == "reproduced"
    # Retention removes a step file by file; listed still, its manifest already gone, it reads as missing.
    os.remove(workdir_lib.manifest_file(workdir, 20))
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    assert verifier.pending_steps() == [20]
    verifier.verify_pending()
    assert verdicts.read(workdir, 20) == proved, "the pass of that save is kept"
    assert verifier.pending_steps() == [], "not tried again by this process"
    line = verifier.ledger.exit_line(committed_steps(workdir))
    assert line.startswith("the verifier could not prove steps [20]: step 20: intact fail (step 20: cannot read its "
                           "manifest (") and line.endswith("its complete verdict reproduced pass is kept "
                                                           "(--reverify=20 replaces it)"), line
    shutil.rmtree(helpers.checkpoint_dir(workdir, "20"))  # the deletion done
    assert verifier.ledger.exit_line(committed_steps(workdir)) is None


def test_resume_from_latest_falls_back_past_a_step_the_verifier_failed(workdir, trained_copy):
    config = trained_copy(workdir, **RUN)
    rewrite_step(config, 30, swap_adam_moments, keep_saved_fingerprints=False)  # wrong, but self-consistent
    assert [v["status"] for v in verify_in_process(workdir).values()] == ["pass", "pass", "fail"]
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint step 30 cannot be restored (step 30: the verifier failed it (reproduced fail: " in result.stderr
    assert "resumed from step 20" in result.stderr and committed_steps(workdir) == [10, 20, 30, 40]
    set_aside = sorted(os.path.basename(p) for p in glob.glob(str(workdir_lib.superseded_dir(workdir) / "30-*")))
    assert len(set_aside) == 2 and set_aside[1].endswith(".verdict.json"), set_aside
