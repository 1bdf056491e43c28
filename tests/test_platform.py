"""The platform record (checkpointing/_src/platform_record.py) and --matmul_precision: what every manifest
records about the hardware and numerics, the flag's way from the command line into the compiled step,
the manifests and the verifier's replay, and runs saved before either existed.

On CPU every precision computes in float32, so these check that the setting is recorded and reaches
the HLO of each dot, not a numeric difference.
"""

import importlib.metadata
import json

import jax
import pytest
from absl import flags

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import platform_record, report
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.checks import check_config_matches
from checkpointing.errors import ConfigMismatchError
from checkpointing._src.run_metadata import RunMetadata
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime import entry, exit_codes
from tests import helpers
from trainer import flags as trainer_flags
from trainer import loop, model_config
from trainer.config import FIXED_FIELDS
from trainer.program import build_mesh, build_program, replay_program, validate

HIGHEST_DOT = "precision = [HIGHEST, HIGHEST]"


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_the_record_is_this_process_and_the_precision_in_effect_when_it_is_taken():
    expected = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                "jax": importlib.metadata.version("jax"), "jaxlib": importlib.metadata.version("jaxlib"),
                "libtpu": _installed("libtpu") or _installed("libtpu-nightly"),
                "matmul_precision": "default", "x64": False}
    assert platform_record.record() == expected
    with jax.default_matmul_precision("float32"):  # a user's loop may set it for a block: read at the call
        assert platform_record.record() == {**expected, "matmul_precision": "float32"}
    assert platform_record.is_valid(expected)
    assert platform_record.describe(expected) == "cpu"
    assert platform_record.describe({**expected, "matmul_precision": "highest"}) == "cpu, highest"
    assert platform_record.describe(None) == "-"


def test_a_save_records_the_precision_of_the_thread_that_called_it(workdir):
    """A user's loop that computes inside `jax.default_matmul_precision(...)`: the manifest is built on
    Orbax's commit thread, which does not see that setting; the record is taken at save() instead."""
    import jax.numpy as jnp

    from checkpointing.config import CheckpointConfig
    from checkpointing._src.service import CheckpointService

    run = RunMetadata(config={"model": "own"}, fixed_fields={}, fixed_hash="own", mesh={"data": 1})
    service = CheckpointService(workdir, CheckpointConfig(max_to_keep=10, async_save=True), run=run)
    with jax.default_matmul_precision("tensorfloat32"):
        service.save(1, {"w": jnp.zeros((8,), jnp.float32)}, losses={0: 1.0}, reason="interval")
    service.close()
    assert read_manifest(workdir, 1)["platform"] == {**platform_record.record(), "matmul_precision": "tensorfloat32"}


def parse(*argv: str):
    """The config the trainer's main builds from `argv` (checked, the disk untouched)."""
    flags.FLAGS.unparse_flags()
    try:
        exit_codes.parse_flags_or_exit(["trainer.train", "--workdir=/unused", *argv])
        return validate(trainer_flags.config_from_flags(), 8, check_workdir=False)
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("given, recorded", [
    ([], "default"), (["--matmul_precision=highest"], "highest"), (["--matmul_precision=float32"], "highest"),
    (["--matmul_precision=tensorfloat32"], "high"), (["--matmul_precision=bfloat16"], "default"),
])
def test_the_flag_is_recorded_under_jaxs_name(given, recorded):
    config = parse(*given)
    assert config.matmul_precision == recorded and config.to_json()["matmul_precision"] == recorded


def test_a_precision_jax_does_not_name_is_refused_with_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        entry.exit_code_of(lambda _: parse("--matmul_precision=fp8"), ["trainer.train"])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr == ["error: --matmul_precision=fp8: must be one of default, high, highest, bfloat16, "
                      "tensorfloat32, float32"]


def test_the_precision_is_fixed_once_set_and_a_default_run_hashes_as_before(tmp_path):
    default = helpers.small_config(str(tmp_path))
    highest = model_config.replace(default, matmul_precision="highest")
    # A run saved before the flag existed recorded the hash of FIXED_FIELDS alone: at the default, the same.
    before_the_flag = RunMetadata.of_run(default.to_json(), FIXED_FIELDS, {"data": 8})
    assert "matmul_precision" not in model_config.fixed_fields(default)
    assert model_config.fixed_hash(default) == before_the_flag.fixed_hash
    assert model_config.fixed_fields(highest)["matmul_precision"] == "highest"
    assert model_config.fixed_hash(highest) != model_config.fixed_hash(default)
    saved = {"fixed_hash": model_config.fixed_hash(highest), "fixed_fields": model_config.fixed_fields(highest)}
    resumed = RunMetadata.of_run(default.to_json(), model_config.fixed_names(default), {"data": 8})
    with pytest.raises(ConfigMismatchError, match="matmul_precision: checkpoint 'highest' vs this run None"):
        check_config_matches(20, saved, resumed)


def lowered_step(program) -> str:
    return program.step_fn.lower(program.abstract_state, program.abstract_batch).as_text()


def test_the_step_is_traced_at_the_configs_precision_whatever_the_callers(tmp_path):
    default = helpers.small_config(str(tmp_path))
    mesh = build_mesh(default)
    highest = lowered_step(build_program(model_config.replace(default, matmul_precision="highest"), mesh))
    dots = highest.count("stablehlo.dot_general")
    assert dots and highest.count(HIGHEST_DOT) == dots, "every dot of the step carries the run's precision"
    with jax.default_matmul_precision("highest"):  # the verifier's own setting must not leak into a replay
        assert HIGHEST_DOT not in lowered_step(build_program(default, mesh))
        recorded = {k: v for k, v in default.to_json().items() if k != "matmul_precision"}  # a manifest from before
        assert HIGHEST_DOT not in lowered_step(replay_program(recorded, mesh))
    replayed = lowered_step(replay_program({**default.to_json(), "matmul_precision": "highest"}, mesh))
    assert replayed.count(HIGHEST_DOT) == dots


@pytest.mark.slow
def test_a_run_records_its_flag_in_every_manifest_and_a_resume_may_not_change_it(workdir):
    ran = helpers.run_module("trainer.train", f"--workdir={workdir}", *helpers.SMALL_FLAGS, "--steps=10",
                             "--save_every_steps=5", "--matmul_precision=float32")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert committed_steps(workdir) == [5, 10]
    for step in (5, 10):
        manifest = read_manifest(workdir, step)
        assert manifest["config"]["matmul_precision"] == "highest"
        assert manifest["fixed_fields"]["matmul_precision"] == "highest"
        assert manifest["platform"] == {**platform_record.record(), "matmul_precision": "highest"}
    before = helpers.disk_state(workdir)
    resumed = helpers.run_module("trainer.train", f"--workdir={workdir}", *helpers.SMALL_FLAGS, "--steps=20")
    helpers.assert_refused(resumed, before, "matmul_precision: checkpoint 'highest' vs this run None")


def strip_to_before_the_record(workdir: str, step: int) -> None:
    """Rewrites `step`'s manifest as a version before the platform record and the flag wrote it."""
    manifest = read_manifest(workdir, step)
    del manifest["platform"], manifest["config"]["matmul_precision"]
    manifest["digest"] = manifest_lib.digest(manifest)
    with open(workdir_lib.manifest_file(workdir, step), "w") as f:
        json.dump(manifest, f)


@pytest.mark.slow
def test_a_run_saved_before_the_record_validates_restores_and_resumes_bit_exact(trained_copy, trained_runs, workdir):
    run = {**helpers.SHARED_RUN, "steps": 20}
    config = trained_copy(workdir, **run)
    old_hashes = {}
    for step in committed_steps(workdir):
        strip_to_before_the_record(workdir, step)
        old = read_manifest(workdir, step)  # validates: the record is optional
        assert "platform" not in old and "matmul_precision" not in old["fixed_fields"]
        old_hashes[step] = old["fixed_hash"]
    assert [row["platform"] for row in report.table_rows(workdir)] == ["-", "-"]
    result = loop.train(model_config.replace(config, steps=30))  # restores step 20 from a manifest without a record
    assert sorted(result.losses) == list(range(20, 30))
    uninterrupted = loop.read_metrics(trained_runs(**{**run, "steps": 30}))
    assert result.losses == {s: uninterrupted[s] for s in range(20, 30)}, "same layout: bit-exact"
    resumed = read_manifest(workdir, 30)
    assert resumed["fixed_hash"] == old_hashes[20] and resumed["platform"] == platform_record.record()
    assert resumed["config"]["matmul_precision"] == "default"
