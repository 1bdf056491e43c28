"""Orbax API the service relies on beyond its public surface: a change in Orbax fails here first."""

import inspect

import orbax.checkpoint as ocp

from checkpointing._src import orbax_hooks, workdir


def test_json_handler_save_fn_is_the_hook_the_manifest_overrides():
    """orbax_hooks.ManifestHandler overrides the private JsonCheckpointHandler._save_fn: the one hook
    inside the background write. If Orbax renames it or changes its arguments, manifests would be
    written without waiting for the fingerprints (or not at all): this must fail loudly."""
    hook = ocp.handlers.JsonCheckpointHandler._save_fn
    assert inspect.iscoroutinefunction(hook)
    assert list(inspect.signature(hook).parameters) == ["self", "x", "directory"]
    assert orbax_hooks.ManifestHandler._save_fn is not hook


def test_the_manifest_file_name_is_set_explicitly():
    handler = orbax_hooks.ManifestHandler()
    assert handler._filename == workdir.MANIFEST_FILE == "metadata"  # where every existing manifest is


def test_the_finalize_threads_wait_is_the_hook_that_records_a_background_failure(tmp_path):
    """orbax_hooks.Manager overrides the private CheckpointManager._wait_for_checkpointers (the finalize thread's
    wait for the background write, which re-raises its error before the thread's cross-process barrier) and
    reads the private _finalize_thread. If Orbax moves either, a write that fails on one process of a pod
    hangs every process again (tests/test_faults_pods.py): this must fail loudly."""
    hook = ocp.CheckpointManager._wait_for_checkpointers
    assert list(inspect.signature(hook).parameters) == ["self"]
    assert orbax_hooks.Manager._wait_for_checkpointers is not hook
    manager = orbax_hooks.Manager(str(tmp_path / "checkpoints"), preemption_decision=lambda step: False)
    try:
        assert manager.finalizing() is False and manager.finished_or_failed() is False
        assert manager.background_failure is None
    finally:
        manager.close()
