"""The manifest: what a checkpoint claims about itself, as schema-checked JSON (never pickle).

Written with the state in the same atomic Orbax step, so a committed step always has one.
Fields:
  format         int, MANIFEST_FORMAT
  step           int, the state's step
  losses         {"<step>": float}: the loss of every step run since the previous checkpoint
                 (the loss of step s is computed from the state at step s, before its update)
  config         the run's full config (JSON object)
  fixed_hash     hash of the config fields a resume must not change
  fixed_fields   those fields, so a mismatch can be named
  mesh           {"axis": size}
  process_count  int
  versions       {"jax": ..., "jaxlib": ..., "flax": ..., "optax": ..., "orbax-checkpoint": ...}
  leaves         {"<key path>": {"shape": [int], "dtype": str, "fingerprint": int}}
  saved_at       ISO-8601 UTC time the manifest was written (during the background save)
  reason         why it was saved: interval, time, final, preemption
  extra          optional JSON object the trainer adds (commit times, the chosen save interval)
  tier           optional: "local" for a step in one process's local directory (absent: persistent)
  process_index  local steps: the process that wrote it; with mesh and process_count, its layout
  local_shards   local steps: digest of the shards that process holds (checkpointing/_src/local_tier.py)
  program        optional: "package.module:factory", what the verifier imports to replay the run
                 (verifier/program.py); null: the Checkpointer was opened without program=, so the
                 run cannot be replayed; absent: the built-in trainer's program (older manifests)
  init_from      optional: {"workdir", "step", "digest"}, the other run's committed step whose params
                 this run started from (--init_from); its proofs start there, not at the seed
  platform       optional: {"backend", "device_kind", "jax", "jaxlib", "libtpu" (str or null),
                 "matmul_precision", "x64"}, what decides the bits besides the config and the layout
                 (checkpointing/_src/platform_record.py), taken when save() is called; absent: unknown
  digest         sha256 of every other field in canonical JSON (sorted keys, no spaces): an edited
                 loss, fingerprint or config field makes the step corrupt instead of framing a
                 neighbour's proof (a check against accidents, not a signature)
Format 1 manifests (before the digest) are still read; format 2 requires the digest.
"""

import datetime
import functools
import hashlib
import importlib.metadata
import json
import math
from typing import Any

import jax

from checkpointing._src import platform_record
from checkpointing.errors import ManifestError

MANIFEST_FORMAT = 2
PERSISTENT, LOCAL = "persistent", "local"  # the tiers a step may live in

_READABLE_FORMATS = (1, 2)
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")

# field -> (type, check of the value); every field is required.
_SCHEMA: dict[str, tuple[type | tuple, Any]] = {
    "format": (int, lambda v: v in _READABLE_FORMATS),
    "step": (int, lambda v: v >= 0),
    # A non-finite loss is no claim worth proving: the step is corrupt.
    "losses": (dict, lambda v: all(k.isdigit() and isinstance(x, float) and math.isfinite(x) for k, x in v.items())),
    "config": (dict, None),
    "fixed_hash": (str, None),
    "fixed_fields": (dict, None),
    "mesh": (dict, lambda v: all(isinstance(s, int) and s > 0 for s in v.values())),
    "process_count": (int, lambda v: v > 0),
    "versions": (dict, lambda v: all(isinstance(x, str) for x in v.values())),
    "leaves": (dict, lambda v: all(
        isinstance(leaf, dict) and isinstance(leaf.get("shape"), list)
        and all(isinstance(d, int) for d in leaf["shape"]) and isinstance(leaf.get("dtype"), str)
        and isinstance(leaf.get("fingerprint"), int) for leaf in v.values())),
    "saved_at": (str, None),
    "reason": (str, None),
}


# Optional fields, checked when present.
_OPTIONAL: dict[str, Any] = {
    "program": lambda v: v is None or (isinstance(v, str) and v.count(":") == 1),
    "init_from": lambda v: isinstance(v, dict) and isinstance(v.get("workdir"), str)
    and isinstance(v.get("step"), int) and not isinstance(v.get("step"), bool) and isinstance(v.get("digest"), str),
    "total_steps": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,  # the run's last step
    "platform": platform_record.is_valid,
}


def package_versions() -> dict[str, str]:
    """The versions of the packages this process imported (a copy: the manifest's own)."""
    return dict(_versions_read_once())


@functools.cache
def _versions_read_once() -> tuple[tuple[str, str], ...]:
    # About 2 ms of metadata reads that every save's manifest paid on its commit thread; and a package
    # upgraded on disk mid-run is not the one that runs.
    return tuple((name, importlib.metadata.version(name)) for name in _PACKAGES)


def leaf_table(tree) -> dict[str, dict]:
    """{key path: {"shape", "dtype"}} of a concrete or abstract tree."""
    return {jax.tree_util.keystr(path): {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def build(*, step: int, leaves: dict[str, dict], fingerprints: dict[str, int], losses: dict[int, float],
          config: dict, fixed_hash: str, fixed_fields: dict, mesh: dict[str, int], reason: str,
          extra: dict | None = None, tier_fields: dict | None = None, identity_fields: dict | None = None,
          platform: dict | None = None) -> dict:
    """`leaves` is leaf_table(state); each entry gets its fingerprint; `tier_fields`: a local step's layout;
    `platform`: platform_record.record() where the state was computed (None: this thread's, now)."""
    leaves = {path: {**leaf, "fingerprint": fingerprints[path]} for path, leaf in leaves.items()}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "losses": {str(s): float(v) for s, v in sorted(losses.items())},
        "config": config,
        "fixed_hash": fixed_hash,
        "fixed_fields": fixed_fields,
        "mesh": dict(mesh),
        "process_count": jax.process_count(),
        "versions": package_versions(),
        "leaves": leaves,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "reason": reason,
        "platform": dict(platform_record.record() if platform is None else platform),
    }
    if extra:  # optional, so older manifests stay valid; covered by the digest like every field
        manifest["extra"] = dict(extra)
    manifest.update(tier_fields or {})  # absent on persistent steps, so their manifests are as before
    manifest.update({k: v for k, v in (identity_fields or {}).items() if v})  # program, init_from, total_steps
    if identity_fields is not None and "program" in identity_fields and identity_fields["program"] is None:
        # null, not absent: an absent program means the built-in trainer's, and the verifier would replay
        # a user's loop with it and name a program the user never used
        manifest["program"] = None
    manifest["digest"] = digest(manifest)
    validate(manifest)
    return manifest


def digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own digest field."""
    content = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def validate(manifest: Any, where: str = "manifest") -> dict:
    """Returns the manifest if it matches the schema; otherwise ManifestError naming the field."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: not a JSON object")
    missing = sorted(set(_SCHEMA) - set(manifest))
    if missing:
        raise ManifestError(f"{where}: missing field(s) {', '.join(missing)}")
    for field, (kind, check) in _SCHEMA.items():
        value = manifest[field]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise ManifestError(f"{where}: field {field!r} must be {kind.__name__}, got {type(value).__name__}")
        if check is not None and not check(value):
            raise ManifestError(f"{where}: field {field!r} has an invalid value")
    for field, check in _OPTIONAL.items():
        if field in manifest and not check(manifest[field]):
            raise ManifestError(f"{where}: field {field!r} has an invalid value")
    if manifest["format"] >= 2 and manifest.get("digest") != digest(manifest):
        raise ManifestError(f"{where}: content does not match its digest (edited or damaged after the save)")
    return manifest


def tier(manifest: dict) -> str:
    """The tier the step was saved to; manifests from before the local tier are persistent."""
    return manifest.get("tier", PERSISTENT)


def losses(manifest: dict) -> dict[int, float]:
    return {int(s): v for s, v in manifest["losses"].items()}


def parse(text: str, where: str) -> dict:
    try:
        # NaN/Infinity are not JSON; Python's parser accepts them, the schema then refuses them.
        return validate(json.loads(text), where)
    except json.JSONDecodeError as err:
        raise ManifestError(f"{where}: not valid JSON ({err})") from None
