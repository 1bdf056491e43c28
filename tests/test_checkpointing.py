"""The checkpoint service on real Orbax and a real disk: restores, refusals, manifests.

Most tests get their own copy of one run trained once per session (RUN, conftest.trained_copy).
"""

import dataclasses
import json
import os
import shutil
import textwrap

import jax
import jax.numpy as jnp
import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import ConfigMismatchError, ManifestError, NoSuchCheckpointError, TreeMismatchError
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers
from trainer import models
from trainer import loop
from verifier.program import replay_losses
from trainer.program import build_mesh, build_program


pytestmark = pytest.mark.slow

RUN = {**helpers.SHARED_RUN, "steps": 20}  # commits 10 (interval) and 20 (final)


def trained_run(workdir, steps=20, save_every_steps=10, **overrides):
    config = helpers.small_config(workdir, steps=steps, save_every_steps=save_every_steps, max_to_keep=50, **overrides)
    return config, loop.train(config)


@pytest.fixture
def trained(trained_copy, workdir):
    """This test's own copy of RUN, in `workdir`: its config."""
    return trained_copy(workdir, **RUN)


def restore_on(config, mesh_name, step):
    config = dataclasses.replace(config, mesh=helpers.MESHES[mesh_name])
    program = build_program(config, build_mesh(config))
    service = helpers.open_service(config, program)
    return program, service.restore(step, program.abstract_state)


@pytest.mark.parametrize("async_save", [True, False])
def test_restore_same_mesh_is_bit_exact_and_keeps_one_executable(workdir, async_save):
    config, result = trained_run(workdir, async_save=async_save)
    assert committed_steps(workdir) == [10, 20]
    program, restored = restore_on(config, "data=4,model=2", 20)
    assert helpers.leaves_equal(restored.state, result.state)
    assert restored.state.step.dtype == jnp.int32 and not restored.state.step.aval.weak_type
    state = restored.state
    for step in range(20, 23):
        state, _ = program.step_fn(state, program.batch_fn(step))
    assert program.step_fn._cache_size() == 1


@pytest.mark.parametrize("mesh_name", ["data=8", "data=2,model=4"])
def test_restore_onto_another_mesh_is_exact_and_continues_within_tolerance(trained, mesh_name):
    config, uninterrupted = trained, loop.read_metrics(trained.workdir)
    program, restored = restore_on(config, mesh_name, 10)  # restore() itself checks every fingerprint
    assert restored.state.params["Dense_0"]["kernel"].sharding.mesh.shape == program.mesh.shape
    saved_on_origin = restore_on(config, "data=4,model=2", 10)[1].state
    assert helpers.leaves_equal(restored.state, saved_on_origin)
    _, resumed = replay_losses(program, restored.state, 10, 10)
    expected = {s: uninterrupted[s] for s in range(10, 20)}
    assert helpers.max_relative_difference(resumed, expected) <= models.resolve("mlp").cross_mesh_loss_rtol


def test_restore_in_a_one_device_process(trained):
    config, uninterrupted = trained, loop.read_metrics(trained.workdir)
    script = textwrap.dedent(f"""
        import dataclasses, json
        from tests import helpers
        from verifier.program import replay_losses
        from trainer import model_config
        from trainer.program import build_mesh, build_program, validate
        import jax
        fields = json.loads({json.dumps(config.to_json())!r})
        config = validate(dataclasses.replace(model_config.from_json(fields), mesh=()), 1)
        program = build_program(config, build_mesh(config))
        restored = helpers.open_service(config, program).restore(10, program.abstract_state)
        _, losses = replay_losses(program, restored.state, 10, 10)
        print(json.dumps(losses))
    """)
    result = helpers.run_python(script, device_count=1)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = {int(s): v for s, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    expected = {s: uninterrupted[s] for s in range(10, 20)}
    assert helpers.max_relative_difference(resumed, expected) <= models.resolve("mlp").cross_mesh_loss_rtol


def test_broken_resumes_are_caught_by_the_loss_list_not_the_first_loss(workdir, trained):
    """Seed 003: a reset step index shows at once; zeroed Adam moments only from the second step."""
    config = trained
    recorded = manifest_lib.losses(read_manifest(workdir, 20))  # losses of steps 10..19
    program, restored = restore_on(config, "data=4,model=2", 10)

    def copy_of_restored():  # the step donates its input, so every replay gets its own buffers
        return jax.tree.map(jnp.copy, restored.state)

    state = copy_of_restored()
    adam = state.opt_state[0]
    no_moments = state.replace(opt_state=(adam._replace(mu=jax.tree.map(jnp.zeros_like, adam.mu),
                                                        nu=jax.tree.map(jnp.zeros_like, adam.nu)),)
                               + tuple(state.opt_state[1:]))
    _, without_moments = replay_losses(program, no_moments, 10, 10)
    _, from_zero = replay_losses(program, copy_of_restored(), 0, 10)
    _, correct = replay_losses(program, copy_of_restored(), 10, 10)

    assert correct == recorded
    from_zero = dict(zip(range(10, 20), from_zero.values()))
    assert from_zero[10] != recorded[10]
    assert without_moments[10] == recorded[10], "missing moments cannot change the first loss"
    assert without_moments != recorded and without_moments[11] != recorded[11]


def test_a_changed_fixed_config_field_is_refused_by_name(trained):
    config = trained
    wider = dataclasses.replace(config, hidden_dim=config.hidden_dim * 2)
    program = build_program(wider, build_mesh(wider))
    with pytest.raises(ConfigMismatchError, match="hidden_dim: checkpoint 64 vs this run 128"):
        helpers.open_service(wider, program).restore(20, program.abstract_state)


def _modified_target(abstract, edit):
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    return edit(paths, [leaf for _, leaf in flat], treedef)


@pytest.mark.parametrize("change, message", [
    ("reshape", r"\.params\['Dense_0'\]\['kernel'\] shape \[16, 64\] in the checkpoint vs \[16, 32\]"),
    ("retype", r"\.params\['Dense_0'\]\['bias'\] dtype float32 in the checkpoint vs bfloat16"),
    ("rename", r"\.params\['Dense_9'\]\['bias'\] missing from the checkpoint; "
               r"\.params\['Dense_0'\]\['bias'\] not in this program"),
    ("remove", r"\.params\['Dense_0'\]\['bias'\] not in this program"),
])
def test_a_tree_mismatch_is_refused_naming_the_path(trained, change, message):
    config = trained
    program = build_program(config, build_mesh(config))
    service = helpers.open_service(config, program)
    abstract = program.abstract_state
    params = jax.tree.map(lambda x: x, abstract.params)
    bias = params["Dense_0"]["bias"]
    if change == "reshape":
        kernel = params["Dense_0"]["kernel"]
        params["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((16, 32), kernel.dtype, sharding=kernel.sharding)
    elif change == "retype":
        params["Dense_0"]["bias"] = jax.ShapeDtypeStruct(bias.shape, jnp.bfloat16, sharding=bias.sharding)
    elif change == "rename":
        params["Dense_9"] = {"bias": params["Dense_0"].pop("bias")}
    else:
        del params["Dense_0"]["bias"]
    with pytest.raises(TreeMismatchError, match=message):
        service.restore(20, abstract.replace(params=params))


def test_a_leftover_temporary_directory_is_never_listed_and_is_cleaned_at_start_up(workdir, trained):
    config = trained
    leftover = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(helpers.checkpoint_dir(workdir, "20"), leftover)  # a full-looking step, never renamed
    assert committed_steps(workdir) == [10, 20]
    # The one-step answer a save's commit check uses agrees with the listing, step by step.
    assert [step for step in (10, 20, 30, 40) if workdir_lib.is_committed(workdir, step)] == [10, 20]
    mesh = build_mesh(config)
    with loop.open_checkpointer(config, mesh) as checkpointer:  # its own watchdog, stopped at close
        program = build_program(config, mesh)
        assert checkpointer.restore_or_init(program.abstract_state, program.init_fn).step == 20
    assert not os.path.exists(leftover)


def test_a_failed_background_save_leaves_the_previous_step_latest(workdir):
    """A real write failure: the file-size limit makes the background write fail with EFBIG."""
    script = textwrap.dedent(f"""
        import resource, signal, time
        from checkpointing.errors import AsyncSaveError
        from tests import helpers
        from verifier.program import replay_losses
        from trainer.program import build_mesh, build_program
        config = helpers.small_config({workdir!r}, steps=10, save_every_steps=5, max_to_keep=50)
        program = build_program(config, build_mesh(config))
        service = helpers.open_service(config, program)
        _, losses = None, None
        state = program.init_fn()
        state, losses = replay_losses(program, state, 0, 5)
        service.save(5, state, losses=losses, reason="interval")
        service.wait_until_finished()
        state, losses = replay_losses(program, state, 5, 5)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
        service.save(10, state, losses=losses, reason="interval")
        try:
            for _ in range(600):
                service.check_for_errors()
                time.sleep(0.05)
            print("NO ERROR")
        except AsyncSaveError as err:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            print("REPORTED:", err)
    """)
    result = helpers.run_python(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REPORTED: background save of step 10 failed" in result.stdout
    assert "the latest committed step is still 5" in result.stdout
    assert committed_steps(workdir) == [5]
    config = helpers.small_config(workdir, steps=10)
    program = build_program(config, build_mesh(config))
    restored = helpers.open_service(config, program).restore(5, program.abstract_state)
    assert int(restored.state.step) == 5


def test_resume_from_none_refuses_a_workdir_with_checkpoints_and_deletes_nothing(workdir, trained):
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=4,model=2",
                                "--batch_size=32", "--resume_from=none", "--steps=30")
    assert helpers.assert_refused(result, before) == (
        f"error: --resume_from=none but {workdir} already has committed steps [10, 20]; "
        "use a new --workdir, --resume_from=latest, or add --rollback to start over from step 0 (they move to "
        "superseded/ with their verdicts)")


@pytest.mark.parametrize("flag, message", [
    ("--resume_from=15", "--resume_from=15: not a committed step (committed: [10, 20])"),
    ("--resume_from=10", "--resume_from=10: newer steps [20] exist; to roll back to it add --rollback"),
    ("--hidden_dim=32", "hidden_dim: checkpoint 64 vs this run 32"),
])
def test_bad_resumes_exit_2_naming_the_problem(workdir, trained, flag, message):
    before = helpers.disk_state(workdir)
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=4,model=2",
                                "--batch_size=32", "--steps=30", flag)
    helpers.assert_refused(result, before, message)
    assert committed_steps(workdir) == [10, 20]


def test_manifest_is_plain_json_validated_on_read(workdir, trained):
    config = trained
    manifest = read_manifest(workdir, 20)
    assert manifest["step"] == 20 and manifest["reason"] == "final"
    assert sorted(manifest_lib.losses(manifest)) == list(range(10, 20))
    assert manifest["mesh"] == {"data": 4, "model": 2} and manifest["process_count"] == 1
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"} <= set(manifest["versions"])
    abstract = build_program(config, build_mesh(config)).abstract_state
    assert {p: {k: v for k, v in leaf.items() if k != "fingerprint"} for p, leaf in manifest["leaves"].items()} \
        == manifest_lib.leaf_table(abstract)
    for root, _, files in os.walk(workdir):
        assert not [f for f in files if f.endswith((".pkl", ".pickle"))], root
    path = str(workdir_lib.manifest_file(workdir, 20))
    for broken, message in [("{not json", "not valid JSON"),
                            (json.dumps({**manifest, "step": "20"}), "field 'step' must be int"),
                            (json.dumps({k: v for k, v in manifest.items() if k != "leaves"}), "missing field")]:
        with open(path, "w") as f:
            f.write(broken)
        with pytest.raises(ManifestError, match=message):
            read_manifest(workdir, 20)


def test_restore_of_a_step_that_is_not_committed_is_refused(trained):
    config = trained
    with pytest.raises(NoSuchCheckpointError, match="step 15 is not a committed checkpoint"):
        restore_on(config, "data=4,model=2", 15)


def test_inspect_lists_committed_steps_and_prints_losses(workdir, trained_copy):
    trained_copy(workdir, **{**RUN, "steps": 30})
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.strip().splitlines()
    assert rows[0].startswith("every step: processes 1, platform cpu") and rows[1].split()[:2] == ["step", "size"]
    assert [row.split()[0] for row in rows[2:]] == ["10", "20", "30"]
    assert "data=4,model=2" in rows[2] and "KiB" in rows[2]
    losses = helpers.run_module("trainer.inspect", f"--workdir={workdir}", "--losses")
    recorded = json.loads(losses.stdout)
    assert list(recorded) == [str(s) for s in range(30)]
    assert {int(s): v for s, v in recorded.items()} == loop.read_metrics(workdir)
