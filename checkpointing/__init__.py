"""A checkpoint service for JAX state trees, on Orbax. Knows nothing about models.

The public API is the names below (docs/api.md gives each one's contract); our trainer reaches the
service only through them, as a user's own loop does (tests/test_layers.py checks it). Names load
lazily, so `from checkpointing import ConfigError` does not import JAX (the trainer holds SIGTERM
before importing it).
"""

import importlib

_PUBLIC = {
    # the service
    "Checkpointer": "checkpointer", "SaveEvent": "saver", "RestoreResult": "restore",
    "restore_subtree": "partial", "Preempted": "saver", "ReplayProgram": "replay",
    # configuration
    "CheckpointConfig": "config", "ConfigError": "config", "AUTO": "config", "option": "config",
    "check_fields": "config", "format_mesh": "config", "resolve_path": "config", "parse_save_every_secs": "config",
    # what a workdir holds, read only
    "Workdir": "workdir", "committed_steps": "workdir", "read_manifest": "workdir", "metrics_file": "workdir",
    "tensorboard_dir": "workdir", "expand_local_dir": "workdir", "check_workdir": "storage",
    "read_input_states": "input_state", "newest_proved_step": "verdicts", "recorded_losses": "report",
    "table_rows": "report",
    "format_table": "report", "draw_plot": "plot_draw", "plot_series": "plot", "reference_loss": "plot",
    "PLOT_FORMATS": "plot", "proof_series": "plot", "read_history": "history", "attempt_record": "history",
    "last_attempt_id": "history", "layout_of": "history",
    # errors
    "CheckpointError": "errors", "BadCheckpointRequest": "errors", "NoSuchCheckpointError": "errors",
    "TreeMismatchError": "errors", "ConfigMismatchError": "errors", "ManifestError": "errors",
    "FingerprintMismatchError": "errors", "AsyncSaveError": "errors", "CorruptCheckpointError": "errors",
    "WorkdirLeasedError": "errors", "LeaseLostError": "errors", "StepAlreadyCommittedError": "errors",
    "StorageUnavailableError": "errors", "InputStateError": "errors", "one_line_cause": "errors",
}
_RENAMED = {"draw_plot": "draw", "plot_series": "series", "PLOT_FORMATS": "FORMATS"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'checkpointing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"checkpointing.{_PUBLIC[name]}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value
