"""The trainer's absl flags, generated from the config's fields: each help text and bound lives on
the field (trainer/config.py, checkpointing/config.py), and `config_from_flags` is the one place the
parsed flags become a TrainConfig. Only the trainer imports this module: the verifier and inspect
define their own flags, so a trainer flag given to them is an error, not silently ignored.
"""

import dataclasses

from absl import flags

from checkpointing import CheckpointConfig, parse_save_every_secs
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
    return [f for f in dataclasses.fields(TrainConfig) if f.name != "checkpoint"] + list(
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


def config_from_flags() -> TrainConfig:
    """The TrainConfig the parsed flags describe (not yet checked against itself or the devices)."""
    if not _FLAGS["workdir"].value:
        raise ConfigError("--workdir is required")
    values = {name: flag.value for name, flag in _FLAGS.items()}
    values["mesh"] = parse_mesh(values["mesh"])
    values["save_every_secs"] = parse_save_every_secs(values["save_every_secs"])
    return TrainConfig.from_flat(values)
