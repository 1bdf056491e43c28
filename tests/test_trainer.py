"""The trainer foundation: one executable, strong int32 step, donation, determinism across meshes.

The fast tier keeps what needs no compile of the step (shapes, shardings, eval_shape).
"""


import jax
import jax.numpy as jnp
import pytest

from tests import helpers
from trainer import models
from trainer import loop
from trainer.program import build_mesh, build_program


def make_program(config):
    return build_program(config, build_mesh(config))


def buffer_pointers(tree) -> list[int]:
    return [shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_step_compiles_once_and_step_stays_strong_int32(workdir, model):
    program = make_program(helpers.small_config(workdir, model))
    state = program.init_fn()
    for step in range(6):
        state, _ = program.step_fn(state, program.batch_fn(step))
    assert program.step_fn._cache_size() == 1
    assert state.step.dtype == jnp.int32
    assert state.step.aval.weak_type is False
    assert int(state.step) == 6


def test_state_is_params_two_adam_moments_and_step(workdir):
    program = make_program(helpers.small_config(workdir))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(program.abstract_state)[0]]
    params = [p for p in paths if p.startswith(".params")]
    assert len([p for p in paths if ".mu" in p]) == len(params) == len([p for p in paths if ".nu" in p])
    assert ".step" in paths


@pytest.mark.slow
def test_donation_deletes_the_input_state(workdir):
    program = make_program(helpers.small_config(workdir))
    state = program.init_fn()
    new_state, _ = program.step_fn(state, program.batch_fn(0))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))


@pytest.mark.slow
def test_init_gives_every_leaf_its_own_buffer(workdir):
    program = make_program(helpers.small_config(workdir))
    state = program.init_fn()
    pointers = buffer_pointers(state)
    assert len(pointers) == len(set(pointers))
    # The check is not vacuous: the seed's shared-zeros state (mu and nu one tree), which a
    # donated step refuses ("Attempt to donate the same buffer twice"), is caught by it.
    adam = state.opt_state[0]
    shared = state.replace(opt_state=(adam._replace(nu=adam.mu),) + tuple(state.opt_state[1:]))
    assert len(set(buffer_pointers(shared))) < len(buffer_pointers(shared))


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_eval_shape_of_the_step_returns_the_state_it_was_given(workdir, model):
    program = make_program(helpers.small_config(workdir, model))
    batch = jax.eval_shape(program.batch_fn, 0)
    new_state, loss = jax.eval_shape(program.step_fn, program.abstract_state, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(program.abstract_state)
    assert [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(new_state)] == [
        (leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(program.abstract_state)]
    assert loss.shape == () and loss.dtype == jnp.float32


def test_params_and_moments_share_the_documented_sharding(workdir):
    program = make_program(helpers.small_config(workdir, "transformer", mesh="data=2,model=4"))
    flat = {jax.tree_util.keystr(p): s.spec
            for p, s in jax.tree_util.tree_flatten_with_path(program.state_shardings)[0]}
    kernels = {p: spec for p, spec in flat.items() if p.startswith(".params") and "kernel" in p}
    assert any("model" in tuple(spec) for spec in kernels.values())
    for path, spec in kernels.items():
        moment = path.replace(".params", ".opt_state[0].mu", 1)
        assert flat[moment] == spec, moment
    assert flat[".step"] == jax.sharding.PartitionSpec()


@pytest.mark.slow
def test_batches_are_the_same_on_every_mesh_and_never_gathered(workdir):
    batches = {}
    for name in helpers.MESHES:
        program = make_program(helpers.small_config(workdir, "transformer", mesh=name))
        batches[name] = jax.device_get(program.batch_fn(7))
        assert program.batch_fn(7)["tokens"].sharding == program.batch_sharding
        hlo = program.batch_fn.lower(7).compile().as_text()
        assert "all-gather" not in hlo and "all-reduce" not in hlo, "the batch must be built shard by shard"
    reference = batches.pop("data=8")
    for name, batch in batches.items():
        assert helpers.leaves_equal(batch, reference), name
    other_step = jax.device_get(make_program(helpers.small_config(workdir, "transformer")).batch_fn(8))
    assert not helpers.leaves_equal(other_step, reference)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_same_mesh_twice_is_bit_identical(workdir, model):
    first = loop.train(helpers.small_config(workdir + "/first", model, steps=30))
    second = loop.train(helpers.small_config(workdir + "/second", model, steps=30))
    assert list(first.losses.values()) == list(second.losses.values())
    assert helpers.leaves_equal(first.state, second.state)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_loss_lists_agree_across_meshes_and_a_one_device_process(tmp_path, model):
    steps = 100
    runs = {}
    for name in helpers.MESHES:
        runs[name] = loop.train(helpers.small_config(str(tmp_path / name), model, name, steps=steps)).losses
    one_device = tmp_path / "one-device"
    sizes = ["--seq_len=16", "--hidden_dim=32"] if model == "transformer" else []
    result = helpers.run_module("trainer.train", f"--workdir={one_device}", f"--model={model}", f"--steps={steps}",
                                "--batch_size=32", "--log_every_steps=5", *sizes, device_count=1)
    assert result.returncode == 0, result.stderr[-2000:]
    runs["1 device"] = loop.read_metrics(str(one_device))
    reference = runs["data=8"]
    assert len(reference) == steps
    spread = {name: helpers.max_relative_difference(losses, reference) for name, losses in runs.items()}
    print(f"{model}: max relative loss difference vs data=8 over {steps} steps: {spread}")
    assert max(spread.values()) <= models.resolve(model).cross_mesh_loss_rtol, spread
    assert reference[steps - 1] < reference[0] / 5, "the loss must fall"
