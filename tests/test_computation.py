"""The computation's identity (trainer/computation.py, trainer/program.py `computation`): the same on every
mesh for the same program, another for other math; and trainer/code.py's rule that it alone decides."""

import types

import jax
import pytest

from tests import helpers
from trainer import code as code_lib
from trainer import computation as computation_lib
from trainer import program as program_lib
from verifier import program as verifier_program


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("computation"))


def test_the_same_program_has_one_digest_on_every_mesh_and_in_the_verifiers_program(workdir):
    for model in ("mlp", "transformer"):
        configs = [helpers.small_config(workdir, model, mesh) for mesh in ("data=8", "data=2,model=4")]
        first, second = (program_lib.computation(config) for config in configs)
        assert first == second, model
        assert set(first) == {"init", "step", "batch"} and all(len(value) == 64 for value in first.values())
    # What the verifier replays with on its own mesh records the same (its program's `code`).
    config = helpers.small_config(workdir, "mlp", "data=2,model=4")
    replayed = program_lib.replay_program(config.to_json(), program_lib.build_mesh(config))
    assert replayed.code["computation"] == program_lib.computation(helpers.small_config(workdir, "mlp", "data=8"))


@pytest.mark.parametrize("overrides, parts", [
    ({"lr_schedule": "warmup_cosine", "warmup_steps": 2, "lr_decay_steps": 10}, {"step"}),
    ({"learning_rate": 0.002}, {"step"}),
    ({"compute_dtype": "bfloat16"}, {"init", "step"}),
    ({"matmul_precision": "highest"}, {"init", "step"}),
    ({"log_every_steps": 7}, set()),  # a cadence computes nothing
])
def test_other_math_is_another_computation(workdir, overrides, parts):
    base = program_lib.computation(helpers.small_config(workdir, "transformer", "data=8"))
    other = program_lib.computation(helpers.small_config(workdir, "transformer", "data=8", **overrides))
    assert {part for part in base if base[part] != other[part]} == parts


def test_a_changed_loss_term_is_another_step_and_addresses_do_not_enter():
    x = jax.ShapeDtypeStruct((4,), jax.numpy.float32)
    loss = lambda v: jax.numpy.sum(jax.nn.relu(v) ** 2)  # noqa: E731  relu: a custom_jvp, its rule is a function
    regularized = lambda v: jax.numpy.sum(jax.nn.relu(v) ** 2) + 1e-4 * jax.numpy.sum(v)  # noqa: E731
    text, _ = computation_lib.jaxpr_text(jax.grad(loss), x)
    assert " at 0x" not in text
    assert computation_lib.digest(jax.grad(loss), x) == computation_lib.digest(jax.grad(loss), x)
    assert computation_lib.digest(jax.grad(loss), x) != computation_lib.digest(jax.grad(regularized), x)
    # A captured array is a constant the jaxpr names but does not print: its values count.
    scale = lambda c: (lambda v: jax.numpy.sum(v * c))  # noqa: E731
    ones, twos = jax.numpy.ones(4), 2 * jax.numpy.ones(4)
    assert computation_lib.digest(scale(ones), x) != computation_lib.digest(scale(twos), x)


def test_the_computation_decides_and_the_rest_is_shown(workdir):
    code = code_lib.identity(helpers.small_config(workdir, "mlp", "data=8"),
                             program_lib.computation(helpers.small_config(workdir, "mlp", "data=8")))
    moved = {**code, "git_commit": "e511377a0978" + "0" * 28, "version": "unknown", "spec_sha256": "1" * 64}
    assert code_lib.changes(moved, code) == [], "another commit, version or source file: the same computation"
    other = {**moved, "computation": {**code["computation"], "step": "2" * 64}}
    changed = code_lib.changes(other, code)
    assert changed[0] == f"computation.step 222222222222 -> {code['computation']['step'][:12]}"
    assert any(item.startswith("git_commit e511377a0978") for item in changed[1:])  # shown, not deciding
    damaged = {**code, "computation": {**code["computation"], "step": float("nan")}}
    assert code_lib.changes(damaged, code)[0].startswith("computation.step nan -> ")
    # A manifest from before the computation was recorded: the old rule (version, spec source, git commit).
    legacy = {name: value for name, value in code.items() if name != "computation"}
    assert code_lib.changes(legacy, code) == []
    assert code_lib.changes({**legacy, "git_commit": "0" * 40}, code)[0].startswith("git_commit 000000000000")
    assert code_lib.changes(None, code) == [] and code_lib.changes(code, None) == []


def test_the_verifier_compares_by_the_computation_and_old_manifests_by_the_old_rule(workdir):
    config = helpers.small_config(workdir, "mlp", "data=8")
    code = code_lib.identity(config, program_lib.computation(config))
    program = types.SimpleNamespace(code=code)
    manifest = lambda step, recorded: {"step": step, "config": {"code": recorded}}  # noqa: E731
    assert verifier_program.code_change(program, [manifest(10, {**code, "git_commit": "e511377a0978"})]) is None
    other = {**code, "computation": {**code["computation"], "step": "3" * 64}}
    assert verifier_program.code_change(program, [manifest(10, code), manifest(20, other)]).startswith(
        "step 20: computation.step 333333333333 -> ")
    legacy = {name: value for name, value in code.items() if name != "computation"}
    assert verifier_program.code_change(program, [manifest(10, legacy)]) is None
    assert "git_commit" in verifier_program.code_change(program, [manifest(10, {**legacy, "git_commit": "0" * 40})])
    assert verifier_program.code_change(types.SimpleNamespace(), [manifest(10, other)]) is None  # a loop's own program
    assert verifier_program.announces_code_change(manifest(30, {**code, "changed_from": ["computation.step a -> b"]}))
    assert not verifier_program.announces_code_change(manifest(30, {**code, "changed_from": "damaged"}))
