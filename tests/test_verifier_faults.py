"""The verifier on damaged steps: corruption after the save, a wrong state saved consistently, an
edited manifest, a loss that does not replay, unreadable arrays, a step deleted mid-proof. Each
fails its own step with a one-line verdict, and its neighbours are still proved."""

import shutil

import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src.workdir import read_manifest
from tests import helpers
from tests.tamper import (KERNEL, MU_KERNEL, RUN, RUN_40, change_step_counter, edit_manifest, flip_one_bit,
                          nan_in_one_leaf, perturb_params, rewrite_step, swap_adam_moments, swap_same_shaped_leaves,
                          truncate_data_files, verify_in_process, zero_adam_moments)
from trainer import loop
from verifier.verifier import Verifier, VerifierOptions

pytestmark = pytest.mark.slow


@pytest.fixture
def trained(trained_copy, workdir):
    """This test's own copy of tamper.RUN (steps 10, 20, 30), in `workdir`: its config."""
    return trained_copy(workdir, **RUN)


@pytest.mark.parametrize("mutate, where", [
    (flip_one_bit, KERNEL),
    (swap_same_shaped_leaves, KERNEL),  # the detail names the other leaf too
])
def test_corruption_after_the_save_fails_the_intact_check_by_leaf(workdir, trained, mutate, where):
    config = trained
    rewrite_step(config, 10, mutate, keep_saved_fingerprints=True)
    found = verify_in_process(workdir)
    verdict = found[10]
    assert (verdict["level"], verdict["status"]) == ("intact", "fail"), verdict
    assert verdict["mismatch"]["where"] == where and where in verdict["detail"]
    if mutate is swap_same_shaped_leaves:
        assert MU_KERNEL in verdict["detail"]
    assert verdict["checkpoint_mesh"] == {"data": 4, "model": 2}
    assert [found[s]["level"] for s in (20, 30)] == ["reproduced"] * 2
    assert found[20]["replayed_from"] == 0, "step 20 is proved from the init, past the broken step 10"


@pytest.mark.parametrize("mutate, where", [(change_step_counter, ".step"), (nan_in_one_leaf, KERNEL)])
def test_a_self_consistent_step_with_a_wrong_counter_or_a_nan_fails_intact(workdir, trained, mutate, where):
    config = trained
    rewrite_step(config, 20, mutate, keep_saved_fingerprints=False)  # fingerprints taken of the wrong state
    found = verify_in_process(workdir)
    assert (found[20]["level"], found[20]["status"]) == ("intact", "fail"), found[20]
    assert found[20]["mismatch"]["where"] == where and "step 20" not in found[10]["detail"]
    assert found[10]["status"] == "pass" and found[30]["status"] == "pass"


@pytest.mark.parametrize("mutate", [swap_adam_moments, zero_adam_moments, perturb_params])
@pytest.mark.parametrize("verifier_mesh", ["data=4,model=2", "data=8"])
def test_a_self_consistent_wrong_step_fails_itself_and_its_neighbours_pass(trained_copy, mutate,
                                                                           verifier_mesh):
    """The trainer saved a wrong state consistently (fingerprints of the wrong arrays): the forward
    proof of that step fails, the step before it stays reproduced, and the step after it is
    reproduced from the one before (on the recording layout and on another)."""
    config = trained_copy(**RUN_40)
    rewrite_step(config, 30, mutate, keep_saved_fingerprints=False)
    found = verify_in_process(config.workdir, mesh=helpers.MESHES[verifier_mesh])
    assert [(found[s]["level"], found[s]["status"]) for s in (10, 20, 30, 40)] == [
        ("reproduced", "pass"), ("reproduced", "pass"), ("reproduced", "fail"), ("reproduced", "pass")], found
    assert found[30]["mismatch"]["kind"] == "leaf" and found[30]["mismatch"]["where"] in found[30]["detail"]
    assert found[30]["replayed_from"] == 20 and found[40]["replayed_from"] == 20
    assert found[40]["compared_losses"] == 10


def test_transformer_across_meshes_blames_only_the_swapped_step(tmp_path):
    """Saved on data=4,model=2, proved on data=8: the per-leaf comparison keeps the key biases'
    rounding noise apart from a real difference, so swapped Adam moments fail on their own step."""
    workdir = str(tmp_path / "run")
    config = helpers.small_config(workdir, model="transformer", steps=40, save_every_steps=10, max_to_keep=100)
    loop.train(config)
    rewrite_step(config, 30, swap_adam_moments, keep_saved_fingerprints=False)
    found = verify_in_process(workdir, mesh=helpers.MESHES["data=8"])
    assert [(found[s]["level"], found[s]["status"]) for s in (10, 20, 30, 40)] == [
        ("reproduced", "pass"), ("reproduced", "pass"), ("reproduced", "fail"), ("reproduced", "pass")], found
    assert found[30]["mismatch"]["where"].startswith((".opt_state[0].mu", ".opt_state[0].nu"))


def test_an_edited_manifest_makes_its_own_step_corrupt_not_its_neighbour(workdir, trained_copy):
    trained_copy(workdir, **RUN_40)
    edit_manifest(workdir, 30, lambda m: m["losses"].update({"25": m["losses"]["25"] * 1.01}))
    found = verify_in_process(workdir)
    assert (found[30]["level"], found[30]["status"]) == ("intact", "fail")
    assert "digest" in found[30]["detail"] and "step 30" in found[30]["detail"]
    assert [found[s]["level"] for s in (10, 20, 40)] == ["reproduced"] * 3
    assert found[40]["replayed_from"] == 20


def test_a_recorded_loss_that_does_not_replay_fails_with_both_values(workdir, trained):
    original = {}

    def edit(manifest):  # a consistent manifest (digest recomputed) whose loss is wrong
        original["15"] = manifest["losses"]["15"]
        manifest["losses"]["15"] = original["15"] * 1.001
        manifest["digest"] = manifest_lib.digest(manifest)

    edit_manifest(workdir, 20, edit)
    verdict = verify_in_process(workdir)[20]
    assert (verdict["level"], verdict["status"]) == ("reproduced", "fail")
    assert verdict["mismatch"] == {"kind": "loss", "where": 15, "expected": original["15"] * 1.001,
                                   "actual": pytest.approx(original["15"], rel=1e-5)}
    assert "step 15" in verdict["detail"]


def test_a_nan_recorded_loss_is_corrupt(workdir, trained):

    def edit(manifest):
        manifest["losses"]["15"] = float("nan")
        manifest["digest"] = manifest_lib.digest(manifest)

    edit_manifest(workdir, 20, edit)
    verdict = verify_in_process(workdir)[20]
    assert (verdict["level"], verdict["status"]) == ("intact", "fail") and "losses" in verdict["detail"]


def test_a_step_deleted_while_being_verified_gets_a_gone_verdict(workdir, trained, monkeypatch):
    """Retention deletes step 20 after the verifier listed it and read its manifest, before the arrays."""
    from verifier import proofs as verifier_lib  # the per-step proofs read each manifest

    def read_then_retention_deletes(directory, step):
        manifest = read_manifest(directory, step)
        if step == 20:
            shutil.rmtree(helpers.checkpoint_dir(workdir, "20"))
        return manifest

    monkeypatch.setattr(verifier_lib, "read_manifest", read_then_retention_deletes)
    found = {v["step"]: v for v in Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),))).verify_pending()}
    assert found[20]["status"] == "gone" and found[10]["status"] == "pass"
    assert (found[30]["level"], found[30]["status"], found[30]["replayed_from"]) == ("reproduced", "pass", 10)


def test_a_truncated_data_file_gives_a_one_line_verdict_naming_the_step(workdir, trained):
    truncate_data_files(workdir, 20)
    verdict = verify_in_process(workdir)[20]
    assert (verdict["level"], verdict["status"]) == ("intact", "fail")
    assert "\n" not in verdict["detail"] and len(verdict["detail"]) < 400, verdict["detail"]
    assert verdict["detail"].startswith("step 20")
