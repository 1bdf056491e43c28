"""The manifest's schema, in-process on hand-built JSON: what a checkpoint claims, checked on read.

tests/test_checkpointing.py checks a real trainer's manifest; these check the rules themselves.
"""

import copy
import importlib.metadata
import json
import math
import os

import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import platform_record
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CorruptCheckpointError, ManifestError
from checkpointing._src.workdir import read_manifest


_BUILD = dict(step=10, leaves={".w": {"shape": [2], "dtype": "float32"}}, fingerprints={".w": 7},
              losses={8: 0.5, 9: 0.25}, config={"seed": 0}, fixed_hash="h", fixed_fields={"seed": 0},
              mesh={"data": 8}, reason="interval")


def _manifest():
    return manifest_lib.build(**_BUILD)


def write(workdir: str, step: int, text: str) -> None:
    path = str(workdir_lib.manifest_file(workdir, step))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize("edit", [
    lambda m: m["losses"].update({"9": 0.2500001}),
    lambda m: m["leaves"][".w"].update({"fingerprint": 8}),
    lambda m: m["config"].update({"seed": 1}),
])
def test_an_edited_manifest_fails_its_digest(edit):
    manifest = _manifest()
    assert manifest_lib.validate(copy.deepcopy(manifest)) == manifest
    edit(manifest)
    with pytest.raises(ManifestError, match="digest"):
        manifest_lib.validate(manifest)


def test_a_manifest_survives_its_json_round_trip_and_refuses_nan_losses():
    manifest = _manifest()
    assert manifest_lib.parse(json.dumps(manifest), "m") == manifest
    manifest["losses"]["9"] = math.nan
    manifest["digest"] = manifest_lib.digest(manifest)
    with pytest.raises(ManifestError, match="losses"):
        manifest_lib.parse(json.dumps(manifest), "m")


def test_build_records_what_a_resume_and_a_proof_need():
    manifest = _manifest()
    assert manifest["format"] == manifest_lib.MANIFEST_FORMAT and manifest["step"] == 10
    assert manifest_lib.losses(manifest) == {8: 0.5, 9: 0.25}
    assert manifest["leaves"] == {".w": {"shape": [2], "dtype": "float32", "fingerprint": 7}}
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"} == set(manifest["versions"])
    assert manifest["process_count"] == 1 and manifest["reason"] == "interval" and "extra" not in manifest
    assert "total_steps" not in manifest  # optional: a manifest without it is as before
    assert manifest["platform"] == platform_record.record()  # what decides the bits (tests/test_platform.py)
    with_total = manifest_lib.build(**{**_BUILD, "identity_fields": {"total_steps": 80}})
    assert with_total["total_steps"] == 80 and manifest_lib.validate(copy.deepcopy(with_total)) == with_total


def test_versions_are_the_installed_ones_and_each_manifest_has_its_own_copy():
    first = _manifest()
    assert first["versions"] == {name: importlib.metadata.version(name) for name in first["versions"]}
    first["versions"]["jax"] = "edited"  # read once per process: an edit must not reach the next manifest
    assert _manifest()["versions"]["jax"] == importlib.metadata.version("jax")


def _resealed(edit):
    """A manifest edited and given a matching digest: only the schema can refuse it."""
    manifest = _manifest()
    edit(manifest)
    manifest["digest"] = manifest_lib.digest(manifest)
    return manifest


@pytest.mark.parametrize("broken, message", [
    ([1, 2], "not a JSON object"),
    (_resealed(lambda m: m.pop("leaves")), "missing field(s) leaves"),
    (_resealed(lambda m: m.update(step="20")), "field 'step' must be int, got str"),
    (_resealed(lambda m: m.update(step=True)), "field 'step' must be int, got bool"),
    (_resealed(lambda m: m.update(step=-1)), "field 'step' has an invalid value"),
    (_resealed(lambda m: m.update(format=3)), "field 'format' has an invalid value"),
    (_resealed(lambda m: m.update(mesh={"data": 0})), "field 'mesh' has an invalid value"),
    (_resealed(lambda m: m["losses"].update({"x": 1.0})), "field 'losses' has an invalid value"),
    (_resealed(lambda m: m["losses"].update({"9": math.inf})), "field 'losses' has an invalid value"),
    (_resealed(lambda m: m["leaves"][".w"].pop("fingerprint")), "field 'leaves' has an invalid value"),
    (_resealed(lambda m: m["leaves"][".w"].update(shape=[2.0])), "field 'leaves' has an invalid value"),
    (_resealed(lambda m: m.update(total_steps="80")), "field 'total_steps' has an invalid value"),
    (_resealed(lambda m: m.update(total_steps=0)), "field 'total_steps' has an invalid value"),
    (_resealed(lambda m: m["platform"].update(libtpu=7)), "field 'platform' has an invalid value"),
    (_resealed(lambda m: m["platform"].update(x64="no")), "field 'platform' has an invalid value"),
    (_resealed(lambda m: m["platform"].pop("matmul_precision")), "field 'platform' has an invalid value"),
    (_resealed(lambda m: m["platform"].update(gpu="A100")), "field 'platform' has an invalid value"),
])
def test_the_schema_names_the_field_that_is_wrong(broken, message):
    with pytest.raises(ManifestError) as refused:
        manifest_lib.validate(broken, "step 10 manifest")
    assert str(refused.value) == f"step 10 manifest: {message}"


def test_a_manifest_from_before_the_platform_record_is_valid_and_its_edited_record_is_not():
    manifest = _resealed(lambda m: m.pop("platform"))
    assert manifest_lib.validate(copy.deepcopy(manifest)) == manifest
    recorded = _manifest()
    recorded["platform"]["matmul_precision"] = "highest"  # claims a precision it was not computed at
    with pytest.raises(ManifestError, match="digest"):
        manifest_lib.validate(recorded)


def test_a_format_1_manifest_without_a_digest_is_still_read():
    manifest = _manifest()
    manifest.update(format=1)
    del manifest["digest"]
    assert manifest_lib.validate(manifest) is manifest
    manifest.update(format=2)
    with pytest.raises(ManifestError, match="does not match its digest"):
        manifest_lib.validate(manifest)


def test_read_manifest_from_its_file_in_the_workdir(tmp_path):
    workdir, manifest = str(tmp_path), _manifest()
    write(workdir, 10, json.dumps(manifest))
    assert read_manifest(workdir, 10) == manifest
    write(workdir, 10, "{not json")
    with pytest.raises(ManifestError, match="^step 10 manifest: not valid JSON"):
        read_manifest(workdir, 10)
    with pytest.raises(CorruptCheckpointError, match="^step 20: cannot read its manifest"):
        read_manifest(workdir, 20)

