"""A workdir has one run: a step from another run, a step replaced after its proof and a damaged
config in a manifest each fail their own verdict (one line) and the verifier goes on; the verifier
stops at SIGTERM and keeps following past an unreadable newest step. Each asserts the exit code,
the last line, and that every committed step is unchanged or moved to superseded/.
The run's identity is its own record (run.json, written once at its first start), else what most of its
steps share: a foreign step fails alone wherever it lies (tests/test_run_record.py: the record itself)."""

import os
import shutil
import signal
import time

import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from tests import helpers
from tests.tamper import RUN, edit_manifest, rewrite_step, swap_adam_moments, verify_in_process

pytestmark = pytest.mark.slow

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]
VERIFY = ["--mesh=data=2", "--once"]


def verify_once(workdir):
    return helpers.run_module("verifier.verify", f"--workdir={workdir}", *VERIFY, device_count=2)


@pytest.mark.parametrize("other, field", [({"seed": 6}, "seed 6 vs 0"), ({"learning_rate": 0.011}, "learning_rate")])
def test_a_step_of_another_run_fails_naming_the_field_and_latest_verified_falls_back(workdir, trained_copy, tmp_path,
                                                                                     other, field):
    trained_copy(workdir, **RUN)
    foreign = trained_copy(str(tmp_path / "other"), **RUN, **other)
    shutil.rmtree(helpers.checkpoint_dir(workdir, "30"))
    shutil.copytree(helpers.checkpoint_dir(foreign.workdir, "30"), helpers.checkpoint_dir(workdir, "30"))
    before = helpers.committed_snapshot(workdir)
    result = verify_once(workdir)
    assert helpers.fault_line(result, 1).startswith("error: failing verdicts for steps [30] (")
    found = verdicts.read_all(workdir)
    assert (found[30]["level"], found[30]["status"]) == ("intact", "fail"), found[30]
    assert "step 30 is not this run's" in found[30]["detail"] and field in found[30]["detail"]
    assert [found[s]["level"] for s in (10, 20)] == ["reproduced"] * 2
    helpers.assert_committed_intact(before, workdir)
    resumed = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                 "--resume_from=latest_verified")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 20" in resumed.stderr
    helpers.assert_committed_intact(before, workdir)  # 30 is moved to superseded/, with its verdict


def test_a_step_replaced_after_its_proof_loses_its_verdict_and_never_anchors(workdir, trained_copy):
    config = trained_copy(workdir, **RUN)
    assert [v["level"] for v in verify_in_process(workdir).values()] == ["reproduced"] * 3
    os.remove(workdir_lib.verdict_file(workdir, 30))  # step 30 still to prove, after 20 is replaced
    rewrite_step(config, 20, swap_adam_moments, keep_saved_fingerprints=False)  # a new save: a new digest
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    assert table.returncode == 0 and [row for row in table.stdout.splitlines() if row.startswith("20 ")][0].endswith(
        "stale: another save (unproved)"), table.stdout
    before = helpers.committed_snapshot(workdir)
    result = verify_once(workdir)
    assert helpers.fault_line(result, 1).startswith("error: failing verdicts for steps [20] (")
    found = verdicts.read_all(workdir)
    assert (found[20]["level"], found[20]["status"]) == ("reproduced", "fail"), found[20]
    assert (found[30]["level"], found[30]["status"], found[30]["replayed_from"]) == ("reproduced", "pass", 10)
    helpers.assert_committed_intact(before, workdir)


def damage(step_config_edit):
    def edit(manifest):
        step_config_edit(manifest["config"])
        manifest["digest"] = manifest_lib.digest(manifest)  # a valid digest: the content itself is wrong
    return edit


@pytest.mark.parametrize("step, edit, named", [
    (20, lambda config: config.update(hidden_dim="64"), "hidden_dim is '64'"),
    (10, lambda config: config.update(hidden_dim="64"), "hidden_dim is '64'"),  # the run's first step
])
def test_a_damaged_config_in_a_manifest_is_that_steps_failed_verdict_and_the_verifier_goes_on(
        workdir, trained_copy, step, edit, named):
    trained_copy(workdir, **RUN)
    edit_manifest(workdir, step, damage(edit))
    before = helpers.committed_snapshot(workdir)
    result = verify_once(workdir)
    assert helpers.fault_line(result, 1).startswith(f"error: failing verdicts for steps [{step}] (")
    found = verdicts.read_all(workdir)
    assert (found[step]["level"], found[step]["status"]) == ("intact", "fail") and named in found[step]["detail"]
    assert "\n" not in found[step]["detail"]
    assert [found[s]["level"] for s in (10, 20, 30) if s != step] == ["reproduced"] * 2
    helpers.assert_committed_intact(before, workdir)


def test_sigterm_stops_the_verifier_within_seconds_and_it_keeps_following_past_an_unreadable_step(
        workdir, trained_copy, tmp_path):
    trained_copy(workdir, **RUN)
    workdir_lib.manifest_file(workdir, 30).write_text("{")  # the newest step: its manifest is unreadable
    before = helpers.committed_snapshot(workdir)
    log = str(tmp_path / "verifier.log")
    with helpers.started_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--follow",
                                "--poll_secs=0.1", "--max_poll_secs=0.2", device_count=2, log_path=log) as verifier:
        deadline = time.monotonic() + 120
        # Step 30's verdict can come first (proved intact during step 10's replay): wait for 20's too.
        while not (verdicts.read(workdir, 30) and (verdicts.read(workdir, 20) or {}).get("complete")) \
                and verifier.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)
        assert verifier.poll() is None, open(log).read()[-3000:]  # before: exit 1 at the unreadable manifest
        signalled = time.monotonic()
        os.kill(verifier.pid, signal.SIGTERM)
        code = verifier.wait(timeout=60)
        took = time.monotonic() - signalled
    text = open(log).read()
    last = text.strip().splitlines()[-1]
    assert code == 1 and last.startswith("error: failing verdicts for steps [30] ("), text[-3000:]
    assert took < 3, f"the verifier took {took:.1f}s to stop"
    assert verdicts.read(workdir, 30)["status"] == "fail" and verdicts.read(workdir, 20)["level"] == "reproduced"
    helpers.assert_committed_intact(before, workdir)


def foreign_step(trained_copy, tmp_path, step: int, **other):
    """The directory of `step` of another run (tamper.RUN with `other`), trained once per session."""
    foreign = trained_copy(str(tmp_path / "other"), **{**RUN, **other})
    return helpers.checkpoint_dir(foreign.workdir, str(step))


def replace_step(workdir: str, step: int, source: str) -> None:
    shutil.rmtree(helpers.checkpoint_dir(workdir, str(step)), ignore_errors=True)
    shutil.copytree(source, helpers.checkpoint_dir(workdir, str(step)))


def levels(found: dict, steps) -> list[tuple[str, str]]:
    return [(found[step]["level"], found[step]["status"]) for step in steps]


@pytest.mark.parametrize("record", [True, False])  # False: a workdir from before run.json (most steps decide)
def test_another_seeds_step_as_the_oldest_fails_alone(workdir, trained_copy, tmp_path, record):
    trained_copy(workdir, **RUN)
    replace_step(workdir, 10, foreign_step(trained_copy, tmp_path, 10, seed=6))
    if not record:
        os.remove(workdir_lib.run_file(workdir))
    found = verify_in_process(workdir)
    assert levels(found, (10, 20, 30)) == [("intact", "fail"), ("reproduced", "pass"), ("reproduced", "pass")], found
    assert found[10]["detail"].startswith("step 10 is not this run's: its fixed config differs (seed 6 vs 0 in "
                                          + ("the run's record (run.json)" if record else "the run of steps 20..30"))
    assert found[20]["replayed_from"] == 0, "proved from the run's own init, past the foreign step"


@pytest.mark.parametrize("record", [True, False])
@pytest.mark.parametrize("copied_as, named", [
    (5, "step 5 is not this run's: its fixed config differs (seed 6 vs 0"),  # its step 5, as an extra older step
    (10, "step 5: its manifest records step 10"),  # its step 10 copied in under another number
])
def test_another_runs_step_copied_in_as_an_older_step_fails_alone(workdir, trained_copy, tmp_path, record,
                                                                  copied_as, named):
    trained_copy(workdir, **RUN)
    foreign = trained_copy(str(tmp_path / "other"), **{**RUN, "steps": 10, "save_every_steps": 5, "seed": 6})
    replace_step(workdir, 5, helpers.checkpoint_dir(foreign.workdir, str(copied_as)))
    if not record:
        os.remove(workdir_lib.run_file(workdir))
    found = verify_in_process(workdir)
    assert levels(found, (5, 10, 20, 30)) == [("intact", "fail")] + [("reproduced", "pass")] * 3, found
    assert found[5]["detail"].startswith(named), found[5]["detail"]
    assert found[10]["replayed_from"] == 0


@pytest.mark.parametrize("step, edit", [
    (10, lambda config: config.pop("log_every_steps")),  # the oldest step, as a version adding it mid-run leaves it
    (20, lambda config: config.update(bogus=1)),  # a field a later version records
])
def test_a_non_fixed_config_field_added_or_removed_is_the_same_run(workdir, trained_copy, step, edit):
    trained_copy(workdir, **RUN)
    edit_manifest(workdir, step, damage(edit))
    found = verify_in_process(workdir)
    assert levels(found, (10, 20, 30)) == [("reproduced", "pass")] * 3, found


def test_a_step_saved_under_another_number_is_corrupt_and_a_resume_falls_back_past_it(workdir, trained_copy):
    trained_copy(workdir, **RUN)
    replace_step(workdir, 30, helpers.checkpoint_dir(workdir, "20"))
    resumed = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint step 30 cannot be restored (step 30: its manifest records step 20 (" in resumed.stderr
    assert "resumed from step 20" in resumed.stderr
