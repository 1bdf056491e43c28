"""A checkpoint service for JAX state trees, on Orbax. Knows nothing about models.

A training loop saves and resumes with five names: `CheckpointConfig`, `Checkpointer`, its
`restore_or_init` and `on_step`, and `Preempted`; `run_main` runs a loop's `main` under the trainer's
exit codes, one-line errors and quiet library logs; the rest of this module's names are what those
return or take. `checkpointing.errors` holds the errors; `checkpointing.config` the parts a config of
one's own composes. Two thin public modules serve tools built on the service: `checkpointing.inspection`
(what a workdir holds, read only: our trainer's metrics and `inspect`) and `checkpointing.verification`
(what a verifier needs). Everything under `checkpointing/_src/` is private: the trainer and the verifier
use only public names (tests/test_layers.py). docs/api.md gives each name's contract. Names load
lazily, so `from checkpointing import ConfigError` does not import JAX (the trainer holds SIGTERM
before importing it).
"""

import importlib

_PUBLIC = {
    "Checkpointer": "_src.checkpointer", "CheckpointConfig": "config", "RestoreResult": "_src.restore",
    "SaveEvent": "_src.saver", "Preempted": "_src.saver", "Workdir": "_src.workdir", "ReplayProgram": "_src.replay",
    "restore_subtree": "_src.partial", "ConfigError": "config", "run_main": "_src.main",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'checkpointing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"checkpointing.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value
