"""The config with its model spec's own fields: built from one flat namespace (flags, a manifest),
changed by flat name, and the names a resume must not change (the Checkpointer hashes them).

Each needs the model registry (which fields the spec declares), and the registry needs TrainConfig:
so these live above both, and trainer/config.py knows only its own fields.
"""

import dataclasses
import hashlib
import json

from checkpointing import CheckpointConfig
from trainer import models
from trainer.config import CODE_FIELD, FIXED_FIELDS, FIXED_WHEN_SET, ConfigError, TrainConfig


def from_flat(fields: dict) -> TrainConfig:
    """A config from one flat namespace of field names (flags, a manifest); unknown names are an error.

    The model spec's own fields (named flat, like any other) are collected into `model_fields`, each
    missing one at its default; CODE_FIELD (what computed a manifest) is identity, not config."""
    own = {f.name for f in dataclasses.fields(TrainConfig)} - {"checkpoint", "model_fields"}
    theirs = {f.name for f in dataclasses.fields(CheckpointConfig)}
    spec_fields = models.resolve(fields.get("model", "mlp")).fields
    names = {f.name for f in spec_fields}
    unknown = sorted(set(fields) - own - theirs - names - {CODE_FIELD, "model_fields"})
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
    given = dict(fields.get("model_fields", ()))
    model_fields = tuple((f.name, fields.get(f.name, given.get(f.name, f.default))) for f in spec_fields)
    checkpoint = CheckpointConfig(**{k: v for k, v in fields.items() if k in theirs})
    return TrainConfig(**{k: v for k, v in fields.items() if k in own}, model_fields=model_fields,
                       checkpoint=checkpoint)


def from_json(fields: dict) -> TrainConfig:
    """The inverse of TrainConfig.to_json (e.g. the config a manifest recorded)."""
    return from_flat({**fields, "mesh": tuple(dict(fields.get("mesh", {})).items())})


def replace(config: TrainConfig, **changes) -> TrainConfig:
    """dataclasses.replace over the flat namespace: checkpoint fields and the spec's own may be named directly."""
    return from_flat({**config.to_json(), "mesh": config.mesh, **changes})


def fixed_names(config: TrainConfig) -> tuple[str, ...]:
    """FIXED_FIELDS and the model spec's fixed fields: the names the Checkpointer hashes."""
    set_fields = tuple(name for name in FIXED_WHEN_SET
                       if getattr(config, name) != TrainConfig.__dataclass_fields__[name].default)
    return FIXED_FIELDS + set_fields + tuple(f.name for f in models.resolve(config.model).fields if f.fixed)


def fixed_fields(config: TrainConfig) -> dict:
    flat = config.to_json()
    return {name: flat[name] for name in fixed_names(config)}


def fixed_hash(config: TrainConfig) -> str:
    """A stable hash of the fields a resume must not change."""
    blob = json.dumps(fixed_fields(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
