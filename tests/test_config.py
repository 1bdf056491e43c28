"""The config and its flags, in-process: each field's help and bounds live once, on the field.

One subprocess smoke test checks the verifier refuses a trainer flag as a user would see it.
"""

import dataclasses

import pytest
from absl import flags

from checkpointing.config import AUTO, CheckpointConfig, ConfigError
from runtime import entry, exit_codes
from tests import helpers
from trainer import flags as trainer_flags
from trainer import model_config
from trainer.config import TrainConfig, parse_mesh
from trainer.program import validate

FLAGS = flags.FLAGS


@pytest.fixture
def parse():
    """Parses trainer flags into the global FLAGS (as app.run would) and resets them afterwards."""

    def parse_flags(*argv: str) -> TrainConfig:
        FLAGS.unparse_flags()
        FLAGS(["trainer.train", "--workdir=/unused", *argv])
        return trainer_flags.config_from_flags()

    yield parse_flags
    FLAGS.unparse_flags()


def config_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in ("checkpoint", "model_fields")] + list(
        dataclasses.fields(CheckpointConfig))


def test_every_config_field_is_a_flag_with_the_fields_own_help():
    names = [field.name for field in config_fields()]
    assert len(names) == len(set(names)), "a checkpoint field shadows a train field"
    for field in config_fields():
        assert FLAGS[field.name].help == field.metadata["help"], field.name


def test_flags_become_the_config_with_checkpoint_fields_composed(parse):
    config = parse("--mesh=data=2,model=4", "--save_every_steps=7", "--save_every_secs=auto", "--noasync_save",
                   "--hidden_dim=48", "--resume_from=latest_verified")
    assert config.mesh == (("data", 2), ("model", 4)) and config.hidden_dim == 48
    assert config.checkpoint == CheckpointConfig(save_every_steps=7, save_every_secs=AUTO, async_save=False,
                                                 resume_from="latest_verified")
    defaults = parse()
    assert defaults == TrainConfig(workdir="/unused"), "a flag default differs from its field's default"


def check(*argv: str) -> TrainConfig:
    """What the trainer's main does with flags before anything touches the disk."""
    FLAGS.unparse_flags()
    exit_codes.parse_flags_or_exit(["trainer.train", "--workdir=/unused", *argv])  # as app.run parses them
    return validate(trainer_flags.config_from_flags(), 8, check_workdir=False)


@pytest.mark.parametrize("argv, line", [
    (["--steps=0"], "error: --steps must be >= 1, got 0"),
    (["--vocab_size=1"], "error: --vocab_size must be >= 2, got 1"),
    (["--learning_rate=nan"], "error: --learning_rate must be a finite number, got nan"),
    (["--lease_secs=0"], "error: --lease_secs must be positive, got 0.0"),
    (["--max_save_overhead=2"], "error: --max_save_overhead must be <= 1, got 2.0"),
    (["--save_every_steps=-1"], "error: --save_every_steps must be >= 0, got -1"),
    (["--save_every_secs=often"], "error: --save_every_secs must be a number of seconds or 'auto', got 'often'"),
    (["--resume_from=yesterday"], "error: --resume_from must be latest, latest_verified, none or a step number, "
                                  "got 'yesterday'"),
    (["--mesh=data=3"], "error: --mesh=data=3 has 3 devices but 8 are visible"),
    (["--mesh=data=8", "--batch_size=12"], "error: --batch_size=12 is not divisible by the data axis (8)"),
    (["--model=transformer", "--hidden_dim=30", "--num_heads=4"], "does not divide"),
    (["--model=rnn"], "rnn"),
    (["--steps=lots"], "error: flag --steps=lots: invalid literal for int() with base 10: 'lots'"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as exited:
        entry.exit_code_of(lambda _: check(*argv), ["trainer.train"])
    FLAGS.unparse_flags()
    assert exited.value.code == 2
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and stderr[0].startswith("error: ") and line in stderr[0], stderr


def test_a_good_config_passes_and_fills_the_mesh():
    config = check("--save_every_secs=30")
    FLAGS.unparse_flags()
    assert config.mesh == (("data", 8),) and config.checkpoint.save_every_secs == 30.0


def test_manifests_keep_one_flat_config_and_read_back():
    config = TrainConfig(workdir="/w", mesh=(("data", 4),), checkpoint=CheckpointConfig(max_to_keep=9))
    recorded = config.to_json()
    assert recorded["max_to_keep"] == 9 and "checkpoint" not in recorded, "the manifest's config stays flat"
    assert model_config.from_json(recorded) == config
    with pytest.raises(ConfigError, match="unknown config field.*colour"):
        model_config.from_json({**recorded, "colour": "blue"})


def test_replace_names_checkpoint_fields_directly():
    config = model_config.replace(TrainConfig(workdir="/w"), steps=7, lease_secs=5.0)
    assert config.steps == 7 and config.checkpoint.lease_secs == 5.0


@pytest.mark.slow  # a subprocess
def test_the_verifier_refuses_a_trainer_flag(tmp_path):
    """The verifier reads the run's config from its manifests: a trainer flag would be silently ignored."""
    result = helpers.run_module("verifier.verify", f"--workdir={tmp_path}", "--once", "--steps=5", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: Unknown command line flag 'steps'"]


def test_one_mesh_module_reads_and_builds_the_mesh_for_the_trainer_the_verifier_and_the_records():
    """runtime/mesh.py: the text, the sizes and the Mesh agree wherever a mesh is read or built."""
    from runtime import mesh as mesh_lib
    from verifier.layouts import other_meshes

    pairs = mesh_lib.parse("model=2,data=4")
    assert pairs == (("model", 2), ("data", 4)) and mesh_lib.format_mesh(pairs) == "model=2,data=4"
    assert mesh_lib.sizes(pairs) == {"data": 4, "model": 2} and mesh_lib.sizes((), 8) == {"data": 8, "model": 1}
    built = mesh_lib.build(pairs)
    assert built.axis_names == mesh_lib.AXES and dict(built.shape) == {"data": 4, "model": 2}
    assert dict(mesh_lib.build().shape) == {"data": 8, "model": 1}, "no sizes: every device on data"
    assert [dict(m.shape) for m in other_meshes(built)][:2] == [{"data": 2, "model": 4}, {"data": 8, "model": 1}]
    with pytest.raises(mesh_lib.MeshError, match="--meshes: axis 'data' given twice"):
        mesh_lib.parse("data=2,data=4", "--meshes")
    with pytest.raises(ConfigError, match="--mesh: unknown axis 'pipe'"):  # the trainer's flags: its ConfigError
        parse_mesh("pipe=2")
