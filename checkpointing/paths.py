"""Paths that are read fresh: local directories, and gs:// without gcsfs's listing cache.

gcsfs caches directory listings per process. A verifier polling for new steps, or a trainer
asking which steps are committed after a background save, must see the bucket as it is now.
"""

from etils import epath


def fresh_path(directory: str) -> epath.Path:
    """epath.Path(directory), with any cached gs:// listing dropped first."""
    if str(directory).startswith("gs://"):
        import fsspec  # only gs:// needs it (installed with the 'gcs' extra)

        for kwargs in ({"finalize_on_close": True}, {}):  # the instances epath and gcsfs users create
            fsspec.filesystem("gcs", **kwargs).invalidate_cache()
    return epath.Path(directory)
