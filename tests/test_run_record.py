"""The run's own record of its identity (<workdir>/run.json, checkpointing/_src/run_record.py): written once at
the run's first start and never rewritten, never written by the verifier; a relaunch that is another run
is refused even before any step committed, and only a deliberate start over replaces it."""

import json
import os

import pytest

from checkpointing._src import run_record, verdicts
from checkpointing._src import workdir as workdir_lib
from tests import helpers
from tests.tamper import RUN, verify_in_process
from verifier import identity

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--log_every_steps=10"]


def record_of(workdir: str) -> dict:
    return json.loads(workdir_lib.run_file(workdir).read_text())


def test_the_record_is_written_at_the_first_start_and_neither_a_relaunch_nor_the_verifier_rewrites_it(
        workdir, trained_copy):
    trained_copy(workdir, **RUN)
    record, manifest = record_of(workdir), workdir_lib.read_manifest(workdir, 10)
    assert (record["fixed_fields"], record["fixed_hash"]) == (manifest["fixed_fields"], manifest["fixed_hash"])
    assert (record["program"], record["init_from"]) == ("trainer.program:replay_program", None)
    assert run_record.read(workdir) == record, "its digest matches"
    before = helpers.snapshot(str(workdir_lib.run_file(workdir)))
    stat = os.stat(workdir_lib.run_file(workdir))
    assert [v["status"] for v in verify_in_process(workdir).values()] == ["pass"] * 3
    resumed = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert helpers.snapshot(str(workdir_lib.run_file(workdir))) == before
    assert os.stat(workdir_lib.run_file(workdir)).st_mtime_ns == stat.st_mtime_ns


def test_a_first_start_that_died_before_its_first_commit_is_still_the_run_and_only_a_start_over_replaces_it(
        workdir, trained_copy):
    trained_copy(workdir, **RUN)
    os.rename(workdir_lib.checkpoints_dir(workdir), f"{workdir}-steps")  # as if no save had committed yet
    before = helpers.disk_state(workdir)
    refused = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=10", "--seed=6", *TRAIN)
    line = helpers.assert_refused(refused, before, f"{workdir_lib.run_file(workdir)} records another run than this "
                                  "one (seed 0 vs 6)", "--resume_from=none --rollback")
    assert line.endswith("to start this workdir over"), line
    old = record_of(workdir)
    over = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=10", "--seed=6",
                              "--resume_from=none", "--rollback", *TRAIN)
    assert over.returncode == 0, over.stderr[-3000:]
    assert record_of(workdir)["fixed_fields"]["seed"] == 6
    moved = [name for name in os.listdir(workdir_lib.superseded_dir(workdir)) if name.startswith("run-")]
    assert len(moved) == 1 and json.loads((workdir_lib.superseded_dir(workdir) / moved[0]).read_text()) == old


def test_a_damaged_record_is_not_trusted_and_the_identity_most_steps_share_is_the_runs(workdir, trained_copy):
    trained_copy(workdir, **RUN)
    record = record_of(workdir)
    record["fixed_fields"]["seed"] = 6  # edited without its digest
    workdir_lib.run_file(workdir).write_text(json.dumps(record))
    run = identity.run_identity(workdir, [10, 20, 30])
    assert run["fixed_fields"]["seed"] == 0 and run["origin"] == "the run of steps 10..30 (3 of 3 steps)"
    assert [v["status"] for v in verify_in_process(workdir).values()] == ["pass"] * 3
    assert verdicts.read(workdir, 10)["level"] == "reproduced"
