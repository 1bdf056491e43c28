"""Real models (issue 19): model state in the tree, per-step rngs, the optimizer from flags or the
spec, a spec's own fields, code identity, and the refusals (exit 2, one line, nothing changed).

Fast: everything here is abstract (eval_shape, no compile of a step) or a refusal.
"""

import jax
import optax
import pytest

from tests import helpers
from trainer import code as code_lib
from trainer import data, model_config, models, train
from trainer import flags as trainer_flags
from trainer.config import CODE_FIELD, FIXED_FIELDS
from trainer.program import build_mesh, build_program

CNN = "examples.cnn_model:spec"
# AdamW, warmup + cosine, clipping and accumulation: every optimizer flag at once.
CNN_OPTIMIZER = dict(optimizer="adamw", weight_decay=1e-4, lr_schedule="warmup_cosine", warmup_steps=4,
                     lr_decay_steps=15, grad_clip_norm=1.0, grad_accum_steps=2, learning_rate=1e-2)


def paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_the_cnn_state_holds_batch_stats_accumulators_and_both_moments(workdir):
    config = helpers.small_config(workdir, CNN, **CNN_OPTIMIZER)
    program = build_program(config, build_mesh(config))
    found = paths(program.abstract_state)
    assert any(p.startswith(".model_state['batch_stats']['BatchNorm_0']['mean']") for p in found), found
    params = [p[len(".params"):] for p in found if p.startswith(".params")]
    for kind in (".mu", ".nu"):
        assert all(any(p.endswith(kind + suffix) for p in found) for suffix in params), kind
    assert all(f".opt_state.acc_grads{suffix}" in found for suffix in params)
    assert ".opt_state.mini_step" in found and ".step" in found


def test_the_step_rng_is_a_function_of_seed_and_step_only(workdir):
    config = helpers.small_config(workdir, CNN)
    other = model_config.replace(config, steps=7, mesh=(("data", 8),))
    first, again = data.step_rng(config, 3), data.step_rng(other, 3)
    assert (jax.random.key_data(first) == jax.random.key_data(again)).all()
    assert not (jax.random.key_data(first) == jax.random.key_data(data.step_rng(config, 4))).all()
    assert not (jax.random.key_data(first) == jax.random.key_data(data.data_key(config))).all()


def test_a_spec_may_bring_its_own_optimizer(workdir):
    config = helpers.small_config(workdir, "tests.model_specs:OWN_OPTIMIZER")
    program = build_program(config, build_mesh(config))
    assert not [p for p in paths(program.abstract_state.opt_state) if ".mu" in p]  # sgd: no moments
    assert isinstance(models.resolve("tests.model_specs:OWN_OPTIMIZER").make_optimizer(config),
                      optax.GradientTransformation)


def test_a_typed_key_in_the_model_state_is_stored_as_its_words(workdir):
    config = helpers.small_config(workdir, "tests.model_specs:KEY_IN_STATE")
    leaf = build_program(config, build_mesh(config)).abstract_state.model_state["noise"]["key"]
    assert leaf.dtype == "uint32" and leaf.shape == (2,)


def test_spec_fields_are_recorded_flat_fixed_and_read_back(workdir):
    config = helpers.small_config(workdir, CNN, dropout_rate=0.3)
    recorded = config.to_json()
    assert recorded["dropout_rate"] == 0.3 and recorded["num_filters"] == 8
    assert set(model_config.fixed_names(config)) == {*FIXED_FIELDS, "dropout_rate", "num_filters", "image_size"}
    assert {"optimizer", "grad_accum_steps", "lr_schedule", "grad_clip_norm"} <= set(FIXED_FIELDS)
    back = model_config.from_json({**recorded, CODE_FIELD: {"version": "x"}})
    assert back == config and back.model_field("dropout_rate") == 0.3
    assert model_config.fixed_hash(config) != model_config.fixed_hash(helpers.small_config(workdir, CNN))


def test_code_identity_names_the_spec_source_and_what_changed(workdir):
    config = helpers.small_config(workdir, CNN)
    code = code_lib.identity(config)
    assert code["spec_module"] == "examples.cnn_model" and "cnn_model.py" in code["spec_files"]
    assert len(code["spec_sha256"]) == 64 and code["version"]
    assert "git_commit" in code and isinstance(code["git_dirty"], bool)  # the worktree is a repository
    changed = code_lib.changes({**code, "spec_sha256": "0" * 64}, code)
    assert len(changed) == 1 and changed[0].startswith("spec_sha256 000000000000 -> ")
    assert code_lib.changes(code, code) == [] and code_lib.changes(None, code) == []


@pytest.mark.parametrize("flags, texts", [
    (["--model=tests.model_specs:LEGACY_BATCHNORM"], ["collection(s) batch_stats", "cannot carry"]),
    (["--model=tests.model_specs:DROPS_NOISE"], ["its loss returns model state []", "unlike the init's ['noise']"]),
    ([f"--model={CNN}", "--dropout_rate=2.0"], ["--dropout_rate must be <= 0.9"]),
    ([f"--model={CNN}", "--num_filters=many"], ["num_filters", "many"]),
    (["--optimizer=sgd"], ["--optimizer=sgd: must be one of adam, adamw"]),
    (["--weight_decay=0.1"], ["--weight_decay=0.1 needs --optimizer=adamw"]),
    (["--grad_accum_steps=0"], ["--grad_accum_steps must be >= 1"]),
    (["--lr_schedule=linear"], ["--lr_schedule=linear"]),
    (["--lr_schedule=warmup_cosine", "--warmup_steps=200"], ["--warmup_steps=200 must be below"]),
    (["--model=transformer", "--compute_dtype=float16"], ["--compute_dtype=float16: must be one of"]),
    (["--model=tests.model_specs:NnxMLP"], ["NnxMLP is a flax.nnx Module", "nnx.bridge.ToLinen"]),
    (["--model=tests.model_specs:NNX_MODULE"], ["make_module returned NnxMLP is a flax.nnx Module"]),
])
def test_bad_model_and_optimizer_input_is_one_line_and_changes_nothing(workdir, flags, texts):
    trainer_flags.define_model_flags(flags)  # as importing trainer.flags does with sys.argv
    before = helpers.disk_state(workdir)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", *flags)
    helpers.assert_refused(result, before, *texts)


def test_a_linen_models_program_is_built_without_importing_flax_nnx(workdir):
    # The nnx refusal answers without importing flax.nnx (about 0.3 s of every start) when nothing imported it.
    script = ("import sys\nfrom tests import helpers\nfrom trainer.program import build_mesh, build_program\n"
              f"config = helpers.small_config({str(workdir)!r}, 'mlp')\nbuild_program(config, build_mesh(config))\n"
              "print('flax.nnx imported:', 'flax.nnx' in sys.modules)")
    proc = helpers.run_python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "flax.nnx imported: False" in proc.stdout, proc.stdout
