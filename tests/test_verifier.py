"""The verifier: a separate read-only process that proves every checkpoint on another mesh, and
what its verdicts decide (resumes, retention, inspect). Damaged steps: test_verifier_faults.py."""

import glob
import os
import shutil

import pytest

from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers
from tests.tamper import (RUN, RUN_10, flip_one_bit, rewrite_step, swap_adam_moments, truncate_data_files,
                          verify_in_process)
from trainer import loop
from tests.verifier_recording import RecordingVerifier
from verifier.verifier import HELD_STATES, Verifier, VerifierOptions

pytestmark = pytest.mark.slow


@pytest.fixture
def trained(trained_copy, workdir):
    """This test's own copy of tamper.RUN (steps 10, 20, 30), in `workdir`: its config."""
    return trained_copy(workdir, **RUN)

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]


def train_subprocess(workdir, steps, *extra):
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", f"--steps={steps}", *TRAIN, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def snapshot(workdir):
    """(path, size, mtime) of every file of every checkpoint step: what the verifier must not touch."""
    files = []
    for root, _, names in os.walk(workdir):
        if os.path.relpath(root, workdir).split(os.sep)[0] == workdir_lib.VERDICTS_DIR:
            continue
        files += [(os.path.join(root, n), os.stat(os.path.join(root, n)).st_size,
                   os.stat(os.path.join(root, n)).st_mtime_ns) for n in names]
    return sorted(files)


def test_follow_verifier_on_another_mesh_proves_every_step_while_training_runs(workdir, tmp_path):
    with helpers.started_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--follow",
                                "--poll_secs=0.2", "--max_poll_secs=1", device_count=2,
                                log_path=str(tmp_path / "verifier.log")) as verifier:
        train_subprocess(workdir, 40)
        assert verifier.wait(timeout=240) == 0, open(tmp_path / "verifier.log").read()[-3000:]
    steps = committed_steps(workdir)
    assert steps == [10, 20, 30, 40]
    found = verdicts.read_all(workdir)
    assert sorted(found) == steps
    assert all(v["status"] == "pass" for v in found.values()), found
    # Proofs run forward: even the final step is reproduced as soon as it commits.
    assert [found[s]["level"] for s in steps] == ["reproduced"] * 4
    for step in steps:
        assert found[step]["complete"] and found[step]["compared_losses"] == 10
        assert found[step]["replayed_steps"] == 10 and found[step]["replayed_from"] == step - 10
        assert found[step]["verifier_mesh"] == {"data": 2, "model": 1}
        assert found[step]["checkpoint_mesh"] == {"data": 4, "model": 2}
        assert 0 <= found[step]["max_relative_difference"] <= 1e-5


def test_same_mesh_verification_is_bit_exact_and_read_only(workdir, trained):
    config = trained
    os.makedirs(os.path.join(workdir, workdir_lib.VERDICTS_DIR))  # where an earlier verifier run wrote
    before = snapshot(workdir), directory_times(workdir)
    found = verify_in_process(workdir, mesh=config.mesh)
    assert (snapshot(workdir), directory_times(workdir)) == before, \
        "the verifier must not change, create or probe anything outside verdicts/"
    for step in (10, 20, 30):
        assert found[step]["level"] == "reproduced" and found[step]["status"] == "pass"
        assert found[step]["max_relative_difference"] == 0.0
        assert "bit-exact" in found[step]["detail"] and "state equals the checkpoint" in found[step]["detail"]


def directory_times(workdir):
    """mtime of every directory but verdicts/: a probe file created and deleted still changes it."""
    return sorted((root, os.stat(root).st_mtime_ns) for root, _, _ in os.walk(workdir)
                  if os.path.basename(root) != workdir_lib.VERDICTS_DIR)


def test_once_proves_two_steps_at_a_time_intact_first_each_restored_once(workdir, trained, restored_steps):
    # A step waiting behind an older one gets its intact verdict before that one's replay, and its
    # one restore serves both of its levels.
    verifier = RecordingVerifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier.verify_pending()
    steps = committed_steps(workdir)
    assert steps == [10, 20, 30]
    expected = []
    for first in range(0, len(steps), HELD_STATES):
        chunk = steps[first:first + HELD_STATES]
        expected += [(step, False) for step in chunk] + [(step, True) for step in chunk]
    assert verifier.writes == expected
    assert restored_steps == steps
    assert [verdicts.read_all(workdir)[step]["level"] for step in steps] == ["reproduced"] * 3
    # A new verifier proves steps intact before it compiles its replay: the first verdicts wait for no compile;
    # then each layout's program (its own, and the other it measures the noise on) compiles its step once.
    assert verifier.compiled_steps[:HELD_STATES] == [0] * HELD_STATES
    assert verifier.compiled_steps[-1] == len(verifier._context.programs) == 2


def test_replay_steps_below_the_interval_is_a_weaker_level_that_never_anchors_a_resume(workdir, trained):
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),), replay_steps=5)).verify_pending()
    found = verdicts.read_all(workdir)
    assert (found[10]["level"], found[10]["status"], found[10]["compared_losses"]) == ("replayed", "pass", 5)
    assert "state is not proved" in found[10]["detail"]
    assert [found[s]["level"] for s in (20, 30)] == ["intact", "intact"]
    assert "not replayed" in found[20]["detail"]
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                "--resume_from=latest_verified")
    helpers.assert_refused(result, before, "was reproduced")


def test_a_step_without_its_commit_marker_is_never_verified_or_touched(workdir, trained):
    leftover = helpers.checkpoint_dir(workdir, "40.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(helpers.checkpoint_dir(workdir, "30"), leftover)
    before = snapshot(workdir)
    found = verify_in_process(workdir)
    assert sorted(found) == [10, 20, 30]
    assert snapshot(workdir) == before


def test_verify_once_exit_codes(workdir, trained, tmp_path):
    config = trained
    cache = tmp_path / "compile-cache"
    ok = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                            f"--compilation_cache_dir={cache}", device_count=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    # Its executables go to the persistent compilation cache, as the trainer's do: a restart loads them.
    cached = {name.split("-")[0] for name in os.listdir(cache)}
    assert {"jit__fingerprints", "jit__finite_flags", "jit_train_step"} <= cached, cached
    rewrite_step(config, 30, flip_one_bit, keep_saved_fingerprints=True)
    os.remove(workdir_lib.verdict_file(workdir, 30))
    failed = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert failed.returncode == 1
    assert "failing verdicts for steps [30]" in failed.stderr
    before = helpers.disk_state(workdir)
    bad = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=3", "--once", device_count=2)
    helpers.assert_refused(bad, before, "error: --mesh=data=3")
    neither = helpers.run_module("verifier.verify", f"--workdir={workdir}", device_count=2)
    helpers.assert_refused(neither, before, "exactly one of --follow and --once")


def test_resume_from_latest_verified_skips_a_failed_step_and_keeps_it(workdir, trained):
    config = trained
    rewrite_step(config, 30, swap_adam_moments, keep_saved_fingerprints=False)  # wrong, but self-consistent
    found = verify_in_process(workdir)
    assert [found[s]["status"] for s in (10, 20, 30)] == ["pass", "pass", "fail"]
    result = train_subprocess(workdir, 40, "--resume_from=latest_verified")
    assert "resumed from step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    set_aside = sorted(os.path.basename(p) for p in glob.glob(str(workdir_lib.superseded_dir(workdir) / "*")))
    assert [name.split("-")[0] for name in set_aside] == ["30", "30"] and set_aside[1].endswith(".verdict.json")
    assert verdicts.read(workdir, 30) is None, "the set-aside step's verdict must not describe the new step 30"
    uninterrupted = helpers.small_config(workdir + "-straight", steps=40, save_every_steps=10, max_to_keep=100)
    loop.train(uninterrupted)
    assert read_manifest(workdir, 40)["losses"] == read_manifest(uninterrupted.workdir, 40)["losses"]


@pytest.mark.parametrize("resume_from", ["latest_verified", "latest"])
def test_a_proved_step_whose_content_is_not_what_its_verdict_proved_is_not_resumed(workdir, trained, resume_from):
    """Each proving verdict records its leaves' sha256 (checkpointing/_src/content.py); a step whose arrays are no
    longer that content (here: the verdict's record of one leaf changed, as arrays edited after the proof
    would be seen) is refused by a resume that trusts its verdict, and set aside."""
    found = verify_in_process(workdir)
    assert all(set(found[s]["content_sha256"]) == set(read_manifest(workdir, s)["leaves"]) for s in (10, 20, 30))
    verdict = verdicts.read(workdir, 30)
    verdict["content_sha256"][".params['Dense_0']['kernel']"] = "0" * 64
    assert verdicts.write(workdir, verdict, replace=True)
    result = train_subprocess(workdir, 40, f"--resume_from={resume_from}")
    assert "resumed from step 20" in result.stderr, result.stderr[-3000:]
    assert "step 30: leaf .params['Dense_0']['kernel'] is not the content its verdict proved" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    assert len(glob.glob(str(workdir_lib.superseded_dir(workdir) / "30-*"))) == 2, "the edited 30, and its verdict"


def test_resume_from_latest_verified_refuses_when_nothing_is_verified(workdir, trained):
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                "--resume_from=latest_verified")
    helpers.assert_refused(result, before, "none of the committed steps [10, 20, 30] was reproduced by the verifier")


def test_a_corrupt_latest_step_falls_back_to_the_previous_one(workdir, trained):
    truncate_data_files(workdir, 30)
    result = train_subprocess(workdir, 40)
    assert "checkpoint step 30 cannot be restored" in result.stderr
    assert "falling back to step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    assert len(glob.glob(str(workdir_lib.superseded_dir(workdir) / "30-*"))) == 1


def test_retention_never_deletes_the_newest_verified_step(workdir, trained_copy):
    trained_copy(workdir, **RUN_10)
    assert verify_in_process(workdir)[10]["status"] == "pass"
    config = helpers.small_config(workdir, steps=60, save_every_steps=10, max_to_keep=2)
    loop.train(config)
    assert committed_steps(workdir) == [10, 50, 60]


def test_inspect_shows_each_steps_verdict(workdir, trained):
    verify_in_process(workdir)
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    rows = table.stdout.strip().splitlines()[1:]  # after the line of what every step shares
    assert rows[0].split()[-1] == "verdict"
    assert all(row.endswith("reproduced pass") for row in rows[1:4])
