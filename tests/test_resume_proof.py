"""The cheap proof (verifier/resume_proof.py): the trainer records a probe a few steps after each save
(checkpointing/_src/probes.py), and the verifier replays those steps from the checkpoint. Seed 003's broken
resumes fail it: a restarted step index at once, zeroed moments one step late (and in the moments'
norms), a sign-flipped moment in the sums; genuine steps pass on another layout, the wide mlp too."""

import jax
import jax.numpy as jnp
import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import probes
from checkpointing._src import verdicts
from checkpointing._src.workdir import read_manifest
from tests import helpers
from tests.tamper import RUN, WIDE, rewrite_step, zero_adam_moments
from trainer import model_config
from trainer.program import build_mesh
from verifier import program as program_lib
from verifier import layouts
from verifier import resume_proof
from verifier.verifier import Verifier, VerifierOptions

pytestmark = pytest.mark.slow


def _verify(workdir, mesh, budget):
    Verifier(VerifierOptions(workdir=workdir, mesh=mesh, verify_budget=budget)).verify_pending()
    return verdicts.read_all(workdir)


def _restored(config, step, mesh_name):
    """(program on `mesh_name`, the restored state of `step`, its manifest)."""
    mesh = build_mesh(model_config.replace(config, mesh=helpers.MESHES[mesh_name]))
    program = program_lib.load(read_manifest(config.workdir, step), mesh)
    restored = helpers.open_service(config, program).restore(step, program.abstract_state)
    return program, restored.state, restored.manifest


def _cheap_proof(config, step, mesh_name, mutate=lambda state: state, replay=program_lib.replay_losses):
    program, state, manifest = _restored(config, step, mesh_name)
    state = mutate(state)
    probe = probes.for_save(config.workdir, step, manifest["digest"])
    others = (program_lib.load(manifest, mesh) for mesh in layouts.other_meshes(program.mesh))
    return resume_proof.prove(replay, program, state, step, probe, manifest, lambda: others, lambda program: None)


def test_each_save_has_a_probe_bound_to_it_that_its_replay_reproduces_bit_for_bit(trained_copy):
    config = trained_copy(**RUN)
    for step in (10, 20):
        manifest = read_manifest(config.workdir, step)
        probe = probes.for_save(config.workdir, step, manifest["digest"])
        assert probe is not None and probe["summary_step"] == step + 4 and probe["mesh"] == {"data": 4, "model": 2}
        assert probe["summary_pass"] == probes.HOST_PASS, "one process on CPU devices: summed on the host"
        later = manifest_lib.losses(read_manifest(config.workdir, step + 10))  # the next save recorded them too
        assert probes.losses(probe) == {s: later[s] for s in range(step, step + 4)}
        result = _cheap_proof(config, step, "data=4,model=2")
        assert result.exact and result.mismatch is None, result.describe()
    assert probes.read(config.workdir, 30) is None, "no step follows the final save"


def test_a_zero_budget_gives_every_save_the_cheap_proof_and_the_final_step_the_full_one(trained_copy):
    config = trained_copy(**RUN)
    found = _verify(config.workdir, (("data", 8),), budget=0.0)
    assert [(found[s]["level"], found[s]["status"]) for s in (10, 20, 30)] == [
        ("resumes", "pass"), ("resumes", "pass"), ("reproduced", "pass")], [found[s]["detail"] for s in found]
    assert [found[s]["replayed_steps"] for s in (10, 20, 30)] == [4, 4, 10]
    assert found[30]["replayed_from"] == 20, "a step the cheap proof passed anchors the next full proof"
    assert not (found[10]["max_relative_difference"] <= 0.0), "another layout: rounding differs a little"


def _restart_step_index(program, state, first, count, batches=None, perturb=None):
    return program_lib.replay_losses(program, state, 0, count, batches, perturb)  # seed 003: the loop restarted at 0


def _zero_moments(state):
    return zero_adam_moments(state)


def _flip_first_moment(state):
    adam = state.opt_state[0]
    flipped = adam._replace(mu=jax.tree.map(jnp.negative, adam.mu))
    return state.replace(opt_state=(flipped,) + tuple(state.opt_state[1:]))


def _reset_counter(state):
    return state.replace(step=jnp.zeros_like(state.step))


@pytest.mark.parametrize("mesh_name", ["data=4,model=2", "data=8"])
def test_seed_003_broken_resumes_and_a_flipped_moment_fail_the_cheap_proof(trained_copy, mesh_name):
    config = trained_copy(**RUN)
    restarted = _cheap_proof(config, 10, mesh_name, replay=_restart_step_index)
    assert restarted.mismatch is not None and restarted.mismatch.kind == "loss" and restarted.mismatch.where == 10
    counter = _cheap_proof(config, 10, mesh_name, mutate=_reset_counter)
    assert counter.mismatch is not None and counter.mismatch.where == ".step", counter.describe()
    zeroed = _cheap_proof(config, 10, mesh_name, mutate=_zero_moments)
    assert zeroed.mismatch is not None, "zeroed moments must not pass"
    assert zeroed.mismatch.where != 10, "the loss of the first step is computed before the update: it matches"
    flipped = _cheap_proof(config, 10, mesh_name, mutate=_flip_first_moment)
    assert flipped.mismatch is not None, flipped.describe()
    genuine = _cheap_proof(config, 10, mesh_name)
    assert genuine.mismatch is None and genuine.exact == (mesh_name == "data=4,model=2"), genuine.describe()


def test_a_save_replaced_after_its_probe_is_not_proved_by_that_probe(trained_copy):
    config = trained_copy(**RUN)
    rewrite_step(config, 20, zero_adam_moments, keep_saved_fingerprints=False)  # a consistent wrong save
    assert probes.for_save(config.workdir, 20, read_manifest(config.workdir, 20)["digest"]) is None
    found = _verify(config.workdir, (("data", 8),), budget=0.0)
    assert (found[10]["level"], found[10]["status"]) == ("resumes", "pass"), found[10]["detail"]
    assert (found[20]["level"], found[20]["status"]) == ("reproduced", "fail"), found[20]["detail"]
    assert (found[30]["status"], found[30]["replayed_from"]) == ("pass", 10), found[30]["detail"]


def test_the_wide_mlp_passes_the_cheap_proof_on_another_layout_and_its_broken_resumes_fail(trained_copy):
    config = trained_copy(**WIDE)
    genuine = _cheap_proof(config, 12, "data=2,model=4")
    assert genuine.mismatch is None and not genuine.exact, genuine.describe()
    zeroed = _cheap_proof(config, 12, "data=2,model=4", mutate=_zero_moments)
    assert zeroed.mismatch is not None and zeroed.mismatch.where != 12, zeroed.describe()
    restarted = _cheap_proof(config, 12, "data=2,model=4", replay=_restart_step_index)
    assert restarted.mismatch is not None and restarted.mismatch.where == 12
