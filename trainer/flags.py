"""The trainer's absl flags, generated from the config's fields: each help text and bound lives on
the field (trainer/config.py, checkpointing/config.py), and `config_from_flags` is the one place the
parsed flags become a TrainConfig. Only the trainer (and verifier.calibrate, which measures a
trainer's model) imports this module: the verifier and inspect define their own flags, so a trainer
flag given to them is an error, not silently ignored.

A model spec's own fields (trainer.models.ModelField) are flags too, --<name>: absl parses once, so
the spec is resolved from the command line's --model before parsing (`define_model_flags`, called at
import with sys.argv); a --model that does not resolve defines nothing and is refused by validate.
"""

import dataclasses
import sys

from absl import flags

from checkpointing import CheckpointConfig
from checkpointing.config import parse_save_every_secs
from trainer import model_config, models
from trainer.config import ConfigError, TrainConfig, parse_mesh

COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None,
    "JAX's persistent compilation cache (local disk per host); unset: $XDG_CACHE_HOME (else ~/.cache)"
    "/jax-checkpoint-service/compile; empty: no cache.")

# Fields given as text and parsed by the config: the mesh ('data=4,model=2'), and a number or 'auto'.
_TEXT_FIELDS = {"mesh": "", "save_every_secs": None}
_DEFINE_BY_TYPE = {bool: flags.DEFINE_boolean, int: flags.DEFINE_integer, float: flags.DEFINE_float,
                   str: flags.DEFINE_string}


def _config_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in ("checkpoint", "model_fields")] + list(
        dataclasses.fields(CheckpointConfig))


def _define(field: dataclasses.Field) -> flags.FlagHolder:
    help_text = field.metadata["help"]
    if field.name in _TEXT_FIELDS:
        default = _TEXT_FIELDS[field.name]
        return flags.DEFINE_string(field.name, str(field.default) if default is None else default, help_text)
    if field.name == "workdir":
        return flags.DEFINE_string(field.name, None, help_text)
    return _DEFINE_BY_TYPE[field.type](field.name, field.default, help_text)


_FLAGS = {field.name: _define(field) for field in _config_fields()}
_MODEL_FLAGS: dict[str, flags.FlagHolder] = {}


def model_from_argv(argv: list[str]) -> str:
    """The --model value a command line gives (the last one wins), or the field's default."""
    model = TrainConfig.model
    for i, arg in enumerate(argv):
        if arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        elif arg == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
    return model


def define_model_flags(argv: list[str]) -> None:
    """Defines --<name> for each field of the spec the command line's --model names (once per name)."""
    try:
        spec = models.resolve(model_from_argv(argv))
    except ConfigError:  # validate refuses it with its one line
        return
    for field in spec.fields:
        if field.name not in _MODEL_FLAGS and field.name not in flags.FLAGS:
            help_text = field.help + (f" ({', '.join(map(str, field.choices))})" if field.choices else "")
            _MODEL_FLAGS[field.name] = _DEFINE_BY_TYPE[field.type](field.name, field.default,
                                                                   f"{spec.name}: {help_text}")


define_model_flags(sys.argv)


def config_from_flags() -> TrainConfig:
    """The TrainConfig the parsed flags describe (not yet checked against itself or the devices)."""
    if not _FLAGS["workdir"].value:
        raise ConfigError("--workdir is required")
    values = {name: flag.value for name, flag in _FLAGS.items()}
    spec_names = {field.name for field in models.resolve(values["model"]).fields}
    values.update({name: flag.value for name, flag in _MODEL_FLAGS.items() if name in spec_names})
    values["mesh"] = parse_mesh(values["mesh"])
    values["save_every_secs"] = parse_save_every_secs(values["save_every_secs"])
    return model_config.from_flat(values)
