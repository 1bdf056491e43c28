"""Orbax 0.12 taught s3:// as it knows gs://, installed on import (tests/test_s3.py pins what it relies on).

Imported by every module that hands Orbax a path or asks it which steps are committed (orbax_hooks.py,
workdir.py), so no process lists an s3:// workdir with Orbax's defaults: they would call a step without
its commit marker committed.
"""

from orbax.checkpoint._src.path import atomicity, atomicity_defaults, gcs_utils
from orbax.checkpoint._src.serialization import tensorstore_utils

from checkpointing._src import object_store


def _s3_as_gcs() -> None:
    """Orbax 0.12 knows gs:// only. An s3:// path would be a relative local path to its TensorStore specs
    ('s3:/bucket': refused), and its steps would commit by a rename, which on S3 is a copy of every object
    then a delete: a step killed mid-copy would be listed as committed. So, as on gs://: arrays through
    TensorStore's own `s3` driver (object_store.s3_spec, no copy through a local disk) in OCDBT data files
    of GCS's target size (400 MiB, not 2 GiB: more objects in flight at once, smaller ranged reads), and a
    commit marker written last, which the listings check."""
    normalize, use_gcs_driver, kvstore_for_gcs = (tensorstore_utils._normalize_path, tensorstore_utils._use_gcs_driver,
                                                  gcs_utils.get_kvstore_for_gcs)
    file_size = tensorstore_utils._get_backend_ocdbt_target_data_file_size
    default_class, item_default_class = (atomicity_defaults.get_default_temporary_path_class,
                                         atomicity_defaults.get_item_default_temporary_path_class)
    s3 = lambda path: object_store.store_of(path) == object_store.S3

    def commit_file_on_s3(original):
        def temporary_path_class(path, *, atomicity_options=None):
            if s3(path) and atomicity_defaults._resolve_temporary_path_class_from_options(atomicity_options) is None:
                return atomicity.CommitFileTemporaryPath  # no mode asked for: Orbax's default for gs://
            return original(path, atomicity_options=atomicity_options)

        return temporary_path_class

    tensorstore_utils._normalize_path = lambda path: (
        "s3://" + normalize(path[len("s3://"):]).lstrip("/") if s3(path) else normalize(path))
    # "Use a bucket's driver" (and skip the check for an absolute local path): gcs's, or s3's just below.
    tensorstore_utils._use_gcs_driver = lambda directory: s3(directory) or use_gcs_driver(directory)
    gcs_utils.get_kvstore_for_gcs = lambda path: object_store.s3_spec(path) if s3(path) else kvstore_for_gcs(path)
    tensorstore_utils._get_backend_ocdbt_target_data_file_size = lambda spec: (
        tensorstore_utils._GCS_OCDBT_TARGET_DATA_FILE_SIZE if isinstance(spec, dict)
        and isinstance(spec.get("base"), dict) and spec["base"].get("driver") == "s3" else file_size(spec))
    atomicity_defaults.get_default_temporary_path_class = commit_file_on_s3(default_class)
    atomicity_defaults.get_item_default_temporary_path_class = commit_file_on_s3(item_default_class)


_s3_as_gcs()
