"""The verifier: a separate read-only process that proves every checkpoint on another mesh."""

import dataclasses
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpointing import workdir as workdir_lib
from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing.service import committed_steps, read_manifest
from tests import helpers
from trainer import checkpoints, loop
from trainer.program import build_mesh, build_program
from trainer.verifier import Verifier, VerifierOptions

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]


def train_subprocess(workdir, steps, *extra):
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", f"--steps={steps}", *TRAIN, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def trained(workdir, steps=30):
    config = helpers.small_config(workdir, steps=steps, save_every_steps=10, max_to_keep=100)
    loop.train(config)
    return config


def verify_in_process(workdir, mesh=(("data", 8),)) -> dict[int, dict]:
    Verifier(VerifierOptions(workdir=workdir, mesh=mesh)).verify_pending()
    return verdicts.read_all(workdir)


def rewrite_step(config, step, mutate, *, keep_saved_fingerprints):
    """Replaces `step` with a mutated copy of its state (a real Orbax save of the new arrays).

    keep_saved_fingerprints=True models corruption after the save (the manifest still describes
    the original arrays); False models a trainer bug that saved the wrong state consistently.
    """
    program = build_program(config, build_mesh(config))
    restored = checkpoints.open_service(config, program).restore(step, program.abstract_state)
    state = mutate(restored.state)
    shutil.rmtree(helpers.checkpoint_dir(config.workdir, str(step)))
    service = checkpoints.open_service(config, program)
    service.save(step, state, losses=manifest_lib.losses(restored.manifest), reason=restored.manifest["reason"])
    service.wait_until_finished()
    if keep_saved_fingerprints:
        with open(os.path.join(helpers.checkpoint_dir(config.workdir, str(step)), "manifest", "metadata"), "w") as f:
            json.dump(restored.manifest, f)


def snapshot(workdir):
    """(path, size, mtime) of every file of every checkpoint step: what the verifier must not touch."""
    files = []
    for root, _, names in os.walk(workdir):
        if os.path.relpath(root, workdir).split(os.sep)[0] == workdir_lib.VERDICTS_DIR:
            continue
        files += [(os.path.join(root, n), os.stat(os.path.join(root, n)).st_size,
                   os.stat(os.path.join(root, n)).st_mtime_ns) for n in names]
    return sorted(files)


@pytest.mark.slow
def test_follow_verifier_on_another_mesh_proves_every_step_while_training_runs(workdir, tmp_path):
    with helpers.started_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--follow",
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


def test_same_mesh_verification_is_bit_exact_and_read_only(workdir):
    config = trained(workdir)
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


def _leaf(state, path):
    return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}[path]


def _replace_leaves(state, replacements: dict):
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [replacements.get(jax.tree_util.keystr(p), leaf) for p, leaf in flat]
    return jax.tree.unflatten(treedef, leaves)


KERNEL = ".params['Dense_1']['kernel']"
MU_KERNEL = ".opt_state[0].mu['Dense_1']['kernel']"


def flip_one_bit(state):
    kernel = _leaf(state, KERNEL)
    host = np.array(kernel)
    host.view(np.uint32)[3, 7] ^= 1 << 4
    return _replace_leaves(state, {KERNEL: jax.device_put(host, kernel.sharding)})


def swap_same_shaped_leaves(state):
    return _replace_leaves(state, {KERNEL: jnp.copy(_leaf(state, MU_KERNEL)), MU_KERNEL: jnp.copy(_leaf(state, KERNEL))})


def zero_adam_moments(state):
    adam = state.opt_state[0]
    return state.replace(opt_state=(adam._replace(mu=jax.tree.map(jnp.zeros_like, adam.mu),
                                                  nu=jax.tree.map(jnp.zeros_like, adam.nu)),) + tuple(state.opt_state[1:]))


def swap_adam_moments(state):
    adam = state.opt_state[0]
    return state.replace(opt_state=(adam._replace(mu=jax.tree.map(jnp.copy, adam.nu),
                                                  nu=jax.tree.map(jnp.copy, adam.mu)),) + tuple(state.opt_state[1:]))


def perturb_params(state):
    """Every parameter scaled by 1 + 1e-3 * noise: a small, plausible-looking wrong state."""
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [leaf * (1 + 1e-3 * jax.random.normal(key, leaf.shape, leaf.dtype)) for leaf, key in zip(leaves, keys)]
    return state.replace(params=jax.tree.unflatten(treedef, noisy))


def change_step_counter(state):
    return state.replace(step=state.step + 1)


def nan_in_one_leaf(state):
    kernel = _leaf(state, KERNEL)
    host = np.array(kernel)
    host[0, 0] = np.nan
    return _replace_leaves(state, {KERNEL: jax.device_put(host, kernel.sharding)})


@pytest.mark.parametrize("mutate, where", [
    (flip_one_bit, KERNEL),
    (swap_same_shaped_leaves, KERNEL),  # the detail names the other leaf too
])
def test_corruption_after_the_save_fails_the_intact_check_by_leaf(workdir, mutate, where):
    config = trained(workdir)
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
def test_a_self_consistent_step_with_a_wrong_counter_or_a_nan_fails_intact(workdir, mutate, where):
    config = trained(workdir)
    rewrite_step(config, 20, mutate, keep_saved_fingerprints=False)  # fingerprints taken of the wrong state
    found = verify_in_process(workdir)
    assert (found[20]["level"], found[20]["status"]) == ("intact", "fail"), found[20]
    assert found[20]["mismatch"]["where"] == where and "step 20" not in found[10]["detail"]
    assert found[10]["status"] == "pass" and found[30]["status"] == "pass"


@pytest.mark.parametrize("mutate", [swap_adam_moments, zero_adam_moments, perturb_params])
@pytest.mark.parametrize("verifier_mesh", ["data=4,model=2", "data=8"])
def test_a_self_consistent_wrong_step_fails_itself_and_its_neighbours_pass(tmp_path, untampered_run, mutate,
                                                                           verifier_mesh):
    """The trainer saved a wrong state consistently (fingerprints of the wrong arrays): the forward
    proof of that step fails, the step before it stays reproduced, and the step after it is
    reproduced from the one before (on the recording layout and on another)."""
    config = tamper_workdir(tmp_path, untampered_run, mutate)
    found = verify_in_process(config.workdir, mesh=helpers.MESHES[verifier_mesh])
    assert [(found[s]["level"], found[s]["status"]) for s in (10, 20, 30, 40)] == [
        ("reproduced", "pass"), ("reproduced", "pass"), ("reproduced", "fail"), ("reproduced", "pass")], found
    assert found[30]["mismatch"]["kind"] == "leaf" and found[30]["mismatch"]["where"] in found[30]["detail"]
    assert found[30]["replayed_from"] == 20 and found[40]["replayed_from"] == 20
    assert found[40]["compared_losses"] == 10


@pytest.fixture(scope="module")
def untampered_run(tmp_path_factory):
    """40 steps of mlp on data=4,model=2, saved every 10: copied by each test that tampers with it."""
    workdir = str(tmp_path_factory.mktemp("untampered") / "run")
    trained(workdir, steps=40)
    return workdir


def tamper_workdir(tmp_path, untampered, mutate, step=30):
    workdir = str(tmp_path / "run")
    shutil.copytree(untampered, workdir)
    config = helpers.small_config(workdir, steps=40, save_every_steps=10, max_to_keep=100)
    rewrite_step(config, step, mutate, keep_saved_fingerprints=False)
    return config


@pytest.mark.slow
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


def edit_manifest(workdir, step, edit):
    path = os.path.join(helpers.checkpoint_dir(workdir, str(step)), "manifest", "metadata")
    manifest = json.load(open(path))
    edit(manifest)
    json.dump(manifest, open(path, "w"))


def test_an_edited_manifest_makes_its_own_step_corrupt_not_its_neighbour(workdir):
    trained(workdir, steps=40)
    edit_manifest(workdir, 30, lambda m: m["losses"].update({"25": m["losses"]["25"] * 1.01}))
    found = verify_in_process(workdir)
    assert (found[30]["level"], found[30]["status"]) == ("intact", "fail")
    assert "digest" in found[30]["detail"] and "step 30" in found[30]["detail"]
    assert [found[s]["level"] for s in (10, 20, 40)] == ["reproduced"] * 3
    assert found[40]["replayed_from"] == 20


def test_a_recorded_loss_that_does_not_replay_fails_with_both_values(workdir):
    trained(workdir)
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


def test_a_nan_recorded_loss_is_corrupt(workdir):
    trained(workdir)

    def edit(manifest):
        manifest["losses"]["15"] = float("nan")
        manifest["digest"] = manifest_lib.digest(manifest)

    edit_manifest(workdir, 20, edit)
    verdict = verify_in_process(workdir)[20]
    assert (verdict["level"], verdict["status"]) == ("intact", "fail") and "losses" in verdict["detail"]


def test_replay_steps_below_the_interval_is_a_weaker_level_that_never_anchors_a_resume(workdir):
    trained(workdir)
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),), replay_steps=5)).verify_pending()
    found = verdicts.read_all(workdir)
    assert (found[10]["level"], found[10]["status"], found[10]["compared_losses"]) == ("replayed", "pass", 5)
    assert "state is not proved" in found[10]["detail"]
    assert [found[s]["level"] for s in (20, 30)] == ["intact", "intact"]
    assert "not replayed" in found[20]["detail"]
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                "--resume_from=latest_verified")
    assert result.returncode == 2 and "was reproduced" in result.stderr.strip().splitlines()[-1]


def test_a_step_without_its_commit_marker_is_never_verified_or_touched(workdir):
    trained(workdir)
    leftover = helpers.checkpoint_dir(workdir, "40.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(helpers.checkpoint_dir(workdir, "30"), leftover)
    before = snapshot(workdir)
    found = verify_in_process(workdir)
    assert sorted(found) == [10, 20, 30]
    assert snapshot(workdir) == before


def test_a_step_deleted_while_being_verified_gets_a_gone_verdict(workdir, monkeypatch):
    """Retention deletes step 20 after the verifier listed it and read its manifest, before the arrays."""
    trained(workdir)
    from trainer import verifier as verifier_lib

    def read_then_retention_deletes(directory, step):
        manifest = read_manifest(directory, step)
        if step == 20:
            shutil.rmtree(helpers.checkpoint_dir(workdir, "20"))
        return manifest

    monkeypatch.setattr(verifier_lib, "read_manifest", read_then_retention_deletes)
    found = {v["step"]: v for v in Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),))).verify_pending()}
    assert found[20]["status"] == "gone" and found[10]["status"] == "pass"
    assert (found[30]["level"], found[30]["status"], found[30]["replayed_from"]) == ("reproduced", "pass", 10)


def test_a_truncated_data_file_gives_a_one_line_verdict_naming_the_step(workdir):
    trained(workdir)
    for data_file in glob.glob(os.path.join(helpers.checkpoint_dir(workdir, "20"), "state", "**", "d", "*"),
                               recursive=True):
        with open(data_file, "r+b") as f:
            f.truncate(8)
    verdict = verify_in_process(workdir)[20]
    assert (verdict["level"], verdict["status"]) == ("intact", "fail")
    assert "\n" not in verdict["detail"] and len(verdict["detail"]) < 400, verdict["detail"]
    assert verdict["detail"].startswith("step 20")


def test_verify_once_exit_codes(workdir):
    config = trained(workdir)
    ok = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    rewrite_step(config, 30, flip_one_bit, keep_saved_fingerprints=True)
    os.remove(workdir_lib.verdict_file(workdir, 30))
    failed = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert failed.returncode == 1
    assert "failing verdicts for steps [30]" in failed.stderr
    bad = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=3", "--once", device_count=2)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --mesh=data=3")
    neither = helpers.run_module("trainer.verify", f"--workdir={workdir}", device_count=2)
    assert neither.returncode == 2 and "exactly one of --follow and --once" in neither.stderr


def test_resume_from_latest_verified_skips_a_failed_step_and_keeps_it(workdir):
    config = trained(workdir)
    rewrite_step(config, 30, swap_adam_moments, keep_saved_fingerprints=False)  # wrong, but self-consistent
    found = verify_in_process(workdir)
    assert [found[s]["status"] for s in (10, 20, 30)] == ["pass", "pass", "fail"]
    result = train_subprocess(workdir, 40, "--resume_from=latest_verified")
    assert "resumed from step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    set_aside = sorted(os.path.basename(p) for p in glob.glob(os.path.join(workdir, "superseded", "*")))
    assert [name.split("-")[0] for name in set_aside] == ["30", "30"] and set_aside[1].endswith(".verdict.json")
    assert verdicts.read(workdir, 30) is None, "the set-aside step's verdict must not describe the new step 30"
    uninterrupted = helpers.small_config(workdir + "-straight", steps=40, save_every_steps=10, max_to_keep=100)
    loop.train(uninterrupted)
    assert read_manifest(workdir, 40)["losses"] == read_manifest(uninterrupted.workdir, 40)["losses"]


def test_resume_from_latest_verified_refuses_when_nothing_is_verified(workdir):
    trained(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                "--resume_from=latest_verified")
    assert result.returncode == 2
    assert "none of the committed steps [10, 20, 30] was reproduced by the verifier" in result.stderr


def test_a_corrupt_latest_step_falls_back_to_the_previous_one(workdir):
    trained(workdir)
    for data_file in glob.glob(os.path.join(helpers.checkpoint_dir(workdir, "30"), "state", "**", "d", "*"), recursive=True):
        with open(data_file, "r+b") as f:
            f.truncate(8)
    result = train_subprocess(workdir, 40)
    assert "checkpoint step 30 cannot be restored" in result.stderr
    assert "falling back to step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    assert len(glob.glob(os.path.join(workdir, "superseded", "30-*"))) == 1


def test_retention_never_deletes_the_newest_verified_step(workdir):
    trained(workdir, steps=10)
    assert verify_in_process(workdir)[10]["status"] == "pass"
    config = dataclasses.replace(helpers.small_config(workdir, steps=60, save_every_steps=10), max_to_keep=2)
    loop.train(config)
    assert committed_steps(workdir) == [10, 50, 60]


def test_inspect_shows_each_steps_verdict(workdir):
    trained(workdir)
    verify_in_process(workdir)
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    rows = table.stdout.strip().splitlines()
    assert rows[0].split()[-1] == "verdict"
    assert all(row.endswith("reproduced pass") for row in rows[1:4])
