"""Every path in a run's workdir, named once (local path or gs://):

    <workdir>/checkpoints/<step>/state/          the arrays (Orbax, TensorStore)
    <workdir>/checkpoints/<step>/manifest/metadata   the manifest (JSON: fingerprints, losses, config)
    <workdir>/superseded/<step>-<time>[.verdict.json]  steps a resume from an older step set aside
    <workdir>/verdicts/<step>.json               the verifier's verdict on one committed step
    <workdir>/lease/<generation>.json            who may write this workdir (checkpointing/lease.py)
    <workdir>/metrics.jsonl, tensorboard/        the trainer's per-step metrics and event files

Orbax owns checkpoints/ alone: on gs:// it treats every directory without a commit marker in its
root as a killed save and deletes it, which would take verdicts or the lease with it.
"""

from etils import epath

CHECKPOINTS_DIR = "checkpoints"
STATE_ITEM = "state"  # Orbax item of the arrays inside a step
MANIFEST_ITEM = "manifest"  # Orbax item of the manifest inside a step
# The manifest's file name inside its item: Orbax's JSON handler default, set explicitly so a change
# of that default cannot hide every existing manifest.
MANIFEST_FILE = "metadata"
SUPERSEDED_DIR = "superseded"
VERDICTS_DIR = "verdicts"
LEASE_DIR = "lease"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def fresh_path(directory: str) -> epath.Path:
    """epath.Path(directory), with any cached gs:// listing dropped first.

    gcsfs caches directory listings per process. A verifier polling for new steps, or a trainer
    asking which steps are committed after a background save, must see the bucket as it is now.
    """
    if str(directory).startswith("gs://"):
        import fsspec  # only gs:// needs it (installed with the 'gcs' extra)

        for kwargs in ({"finalize_on_close": True}, {}):  # the instances epath and gcsfs users create
            fsspec.filesystem("gcs", **kwargs).invalidate_cache()
    return epath.Path(directory)


def _join(workdir: str, *parts: str) -> str:
    return "/".join([str(workdir).rstrip("/"), *parts])


def checkpoints_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, CHECKPOINTS_DIR))


def step_dir(workdir: str, step: int) -> epath.Path:
    return epath.Path(_join(workdir, CHECKPOINTS_DIR, str(step)))


def manifest_file(workdir: str, step: int) -> epath.Path:
    return step_dir(workdir, step) / MANIFEST_ITEM / MANIFEST_FILE


def superseded_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, SUPERSEDED_DIR))


def verdicts_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, VERDICTS_DIR))


def verdict_file(workdir: str, step: int) -> epath.Path:
    return verdicts_dir(workdir) / f"{step}.json"


def lease_dir(workdir: str) -> str:
    """A string: the lease store takes gs:// URLs and local paths as they are."""
    return _join(workdir, LEASE_DIR)


def metrics_file(workdir: str) -> str:
    return _join(workdir, METRICS_FILE)


def tensorboard_dir(workdir: str) -> str:
    return _join(workdir, TENSORBOARD_DIR)
