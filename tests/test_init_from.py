"""A params-only (partial) restore, and a run started from another run's committed step (--init_from):
recorded in every manifest, proved by the verifier from the imported params' fingerprints."""

import os

import jax
import numpy as np
import pytest

from checkpointing.errors import FingerprintMismatchError, TreeMismatchError
from checkpointing import restore_subtree
from checkpointing._src import verdicts
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers, tamper
from trainer import loop, train
from trainer.program import build_mesh, build_program

SOURCE = {**helpers.SHARED_RUN, "steps": 30}  # the shared run: steps 10, 20, 30


@pytest.mark.slow
def test_a_params_only_restore_equals_the_whole_restore_onto_another_mesh(trained_runs):
    source = trained_runs(**SOURCE)
    config = helpers.small_config(source, mesh="data=8", **SOURCE)
    program = build_program(config, build_mesh(config))
    params, manifest = restore_subtree(source, 20, "params", program.abstract_state.params)
    whole = helpers.open_service(config, program).restore(20, program.abstract_state).state
    assert manifest["step"] == 20
    assert helpers.leaves_equal(params, whole.params)
    assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(program.abstract_state.params)[0].sharding
    wrong = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((*leaf.shape, 1), leaf.dtype, sharding=leaf.sharding),
                         program.abstract_state.params)
    with pytest.raises(TreeMismatchError, match=r"\.params\['Dense_0'\]\['bias'\] is float32\[64\] in the checkpoint"):
        restore_subtree(source, 20, "params", wrong)


@pytest.mark.slow
def test_a_flipped_param_fails_the_partial_restore_by_name(trained_copy):
    config = trained_copy(**SOURCE)
    tamper.rewrite_step(config, 20, tamper.flip_one_bit, keep_saved_fingerprints=True)
    program = build_program(config, build_mesh(config))
    with pytest.raises(FingerprintMismatchError, match=r"leaf \.params\['Dense_1'\]\['kernel'\]"):
        restore_subtree(config.workdir, 20, "params", program.abstract_state.params)


@pytest.mark.slow
def test_a_run_started_from_another_runs_step_records_it_and_is_proved_from_it(trained_runs, tmp_path):
    source, workdir = trained_runs(**SOURCE), str(tmp_path / "finetune")
    config = helpers.small_config(workdir, mesh="data=8", steps=20, save_every_steps=10, init_from=f"{source}:20")
    result = loop.train(config)
    first = read_manifest(workdir, 10)
    assert first["init_from"] == {"workdir": source, "step": 20, "digest": read_manifest(source, 20)["digest"]}
    assert read_manifest(workdir, 20)["init_from"] == first["init_from"]
    fresh = loop.train(helpers.small_config(str(tmp_path / "fresh"), mesh="data=8", steps=20, save_every_steps=10))
    assert not result.losses[0] == fresh.losses[0], "the imported params, not the seed's, computed step 0"

    # On the recording layout bit for bit; on another (the first steps after an import move the fresh Adam
    # moments far more than later ones) within the noise the verifier measures for those very steps.
    for mesh, devices in (("data=8", 8), ("data=2", 2)):
        helpers.shutil.rmtree(os.path.join(workdir, "verdicts"), ignore_errors=True)
        verdict_run = helpers.run_module("verifier.verify", f"--workdir={workdir}", f"--mesh={mesh}", "--once",
                                         device_count=devices)
        assert verdict_run.returncode == 0, verdict_run.stderr[-3000:]
        found = verdicts.read_steps(workdir, committed_steps(workdir))
        assert {s: (v["level"], v["status"]) for s, v in found.items()} == {10: ("reproduced", "pass"),
                                                                           20: ("reproduced", "pass")}, found
        assert f"the params of step 20 of {source}" in found[10]["detail"]
        assert ("bit-exact" in found[10]["detail"]) == (mesh == "data=8"), found[10]["detail"]


@pytest.mark.slow
def test_a_gone_init_from_source_leaves_the_first_full_proof_inconclusive_and_every_step_proved(trained_copy,
                                                                                                 tmp_path):
    """The source run's own retention deleted the step this run started from: the first interval cannot be
    replayed (before: the verifier exited 2 at the first step and no step ever got a verdict)."""
    source = trained_copy(str(tmp_path / "source"), **SOURCE).workdir
    workdir = str(tmp_path / "finetune")
    loop.train(helpers.small_config(workdir, mesh="data=8", steps=30, save_every_steps=10, init_from=f"{source}:20"))
    helpers.shutil.rmtree(helpers.checkpoint_dir(source, "20"))
    verdict_run = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=8", "--once")
    assert verdict_run.returncode == 0, verdict_run.stderr[-3000:]
    found = verdicts.read_steps(workdir, committed_steps(workdir))
    assert (found[10]["level"], found[10]["status"]) == ("resumes", "pass"), found[10]["detail"]
    assert "the full proof could not decide: the full proof cannot start from the params of step 20" in \
        found[10]["detail"] and "is not a committed checkpoint" in found[10]["detail"], found[10]["detail"]
    assert [(found[s]["level"], found[s]["status"], found[s]["replayed_from"]) for s in (20, 30)] == [
        ("reproduced", "pass", 10), ("reproduced", "pass", 20)], [found[s]["detail"] for s in (20, 30)]


@pytest.mark.slow  # trains the source run
def test_init_from_a_step_that_is_not_committed_is_refused_with_one_line(trained_runs, tmp_path):
    source, workdir = trained_runs(**SOURCE), str(tmp_path / "run")
    before = helpers.disk_state(workdir, source)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", "--mesh=data=8", f"--init_from={source}:25")
    helpers.assert_refused(result, before, f"--init_from={source}:25: not a committed step", "[10, 20, 30]")


@pytest.mark.slow  # trains the source run (when no slow test did first)
def test_the_imported_params_are_checked_against_the_recorded_digest(trained_copy, tmp_path):
    """The verifier (and a fresh start) use an imported step only if it is the save the run recorded."""
    from checkpointing._src.restore import fresh_state
    from checkpointing.errors import CorruptCheckpointError

    config = trained_copy(**SOURCE)
    program = build_program(config, build_mesh(config))
    recorded = {"workdir": config.workdir, "step": 20, "digest": "0" * 64}
    with pytest.raises(CorruptCheckpointError, match="is not the save this run started from"):
        fresh_state(program.init_fn, program.abstract_state, recorded)
    genuine = {**recorded, "digest": read_manifest(config.workdir, 20)["digest"]}
    state = fresh_state(program.init_fn, program.abstract_state, genuine)
    assert int(state.step) == 0 and np.all(np.asarray(jax.tree.leaves(state.opt_state)[0]) == 0)
