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
        if os.path.relpath(root, workdir).split(os.sep)[0] == verdicts.VERDICTS_DIR:
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
    assert [found[s]["level"] for s in steps] == ["reproducible"] * 3 + ["intact"]
    for step in steps[:-1]:
        assert found[step]["replayed_steps"] == 10 and found[step]["successor"] == step + 10
        assert found[step]["verifier_mesh"] == {"data": 2, "model": 1}
        assert found[step]["checkpoint_mesh"] == {"data": 4, "model": 2}
        assert 0 <= found[step]["max_relative_difference"] <= 1e-5


def test_same_mesh_verification_is_bit_exact_and_read_only(workdir):
    config = trained(workdir)
    before = snapshot(workdir)
    found = verify_in_process(workdir, mesh=config.mesh)
    assert snapshot(workdir) == before, "the verifier must not change any checkpoint file"
    for step in (10, 20):
        assert found[step]["level"] == "reproducible" and found[step]["status"] == "pass"
        assert found[step]["max_relative_difference"] == 0.0
        assert "bit-exact" in found[step]["detail"] and "state equals the successor" in found[step]["detail"]


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


def change_step_counter(state):
    return state.replace(step=state.step + 1)


@pytest.mark.parametrize("mutate, keep_fingerprints, level, where", [
    (flip_one_bit, True, "intact", KERNEL),
    (swap_same_shaped_leaves, True, "intact", KERNEL),  # the detail names the other leaf too
    (zero_adam_moments, False, "reproducible", 11),  # only the second replayed loss can differ
    (change_step_counter, False, "intact", ".step"),
])
def test_mutations_are_caught_naming_what_is_wrong(workdir, mutate, keep_fingerprints, level, where):
    config = trained(workdir)
    rewrite_step(config, 10, mutate, keep_saved_fingerprints=keep_fingerprints)
    found = verify_in_process(workdir)
    verdict = found[10]
    assert (verdict["level"], verdict["status"]) == (level, "fail"), verdict
    assert verdict["mismatch"]["where"] == where, verdict
    assert str(where) in verdict["detail"]
    if mutate is swap_same_shaped_leaves:
        assert MU_KERNEL in verdict["detail"]
    assert verdict["checkpoint_mesh"] == {"data": 4, "model": 2}
    assert found[20]["status"] == "pass"


def test_altered_losses_in_a_manifest_are_caught_with_both_values(workdir):
    trained(workdir)
    path = os.path.join(helpers.checkpoint_dir(workdir, "20"), "manifest", "metadata")
    manifest = json.load(open(path))
    original = manifest["losses"]["15"]
    manifest["losses"]["15"] = original * 1.001
    json.dump(manifest, open(path, "w"))
    verdict = verify_in_process(workdir)[10]
    assert (verdict["level"], verdict["status"]) == ("reproducible", "fail")
    assert verdict["mismatch"] == {"kind": "loss", "where": 15, "expected": original * 1.001,
                                   "actual": pytest.approx(original, rel=1e-5)}
    assert "step 15" in verdict["detail"]


def test_a_step_without_its_commit_marker_is_never_verified_or_touched(workdir):
    trained(workdir)
    leftover = helpers.checkpoint_dir(workdir, "40.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(helpers.checkpoint_dir(workdir, "30"), leftover)
    before = snapshot(workdir)
    found = verify_in_process(workdir)
    assert sorted(found) == [10, 20, 30]
    assert found[30]["level"] == "intact", "a half-written step is no successor"
    assert snapshot(workdir) == before


def test_a_step_deleted_while_being_verified_gets_a_gone_verdict(workdir):
    trained(workdir)
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    shutil.rmtree(helpers.checkpoint_dir(workdir, "20"))  # retention deleted it after the listing
    verdict = verifier.verify(20)
    assert verdict["status"] == "gone"


def test_verify_once_exit_codes(workdir):
    config = trained(workdir)
    ok = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    rewrite_step(config, 30, flip_one_bit, keep_saved_fingerprints=True)
    os.remove(verdicts.verdict_path(workdir, 30))
    failed = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert failed.returncode == 1
    assert "failing verdicts for steps [30]" in failed.stderr
    bad = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=3", "--once", device_count=2)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --mesh=data=3")
    neither = helpers.run_module("trainer.verify", f"--workdir={workdir}", device_count=2)
    assert neither.returncode == 2 and "exactly one of --follow and --once" in neither.stderr


def test_resume_from_latest_verified_skips_a_failed_step_and_keeps_it(workdir):
    config = trained(workdir)
    rewrite_step(config, 30, zero_adam_moments, keep_saved_fingerprints=True)  # its verdict fails
    found = verify_in_process(workdir)
    assert [found[s]["status"] for s in (10, 20, 30)] == ["pass", "pass", "fail"]
    result = train_subprocess(workdir, 40, "--resume_from=latest_verified")
    assert "resumed from step 20" in result.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40]
    assert [os.path.basename(p).split("-")[0] for p in glob.glob(os.path.join(workdir, "superseded", "*"))] == ["30"]
    uninterrupted = helpers.small_config(workdir + "-straight", steps=40, save_every_steps=10, max_to_keep=100)
    loop.train(uninterrupted)
    assert read_manifest(workdir, 40)["losses"] == read_manifest(uninterrupted.workdir, 40)["losses"]


def test_resume_from_latest_verified_refuses_when_nothing_is_verified(workdir):
    trained(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=40", *TRAIN,
                                "--resume_from=latest_verified")
    assert result.returncode == 2
    assert "none of the committed steps [10, 20, 30] has a passing verdict" in result.stderr


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
    table = helpers.run_module("checkpointing.inspect", f"--workdir={workdir}")
    rows = table.stdout.strip().splitlines()
    assert rows[0].split()[-1] == "verdict"
    assert rows[1].endswith("reproducible pass") and rows[3].endswith("intact pass")
