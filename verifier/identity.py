"""Which run a workdir holds, and whether a step belongs to it.

A workdir has one run: the fixed config (the fields a resume must not change, their hash), the
program and the init_from of its oldest committed step whose manifest is consistent (its config's
fixed fields are its recorded fixed_fields and hash to its fixed_hash). A step whose identity
differs (another seed, another learning rate, another program, a config field this run does not
have, a config value that is not its fixed field) is not this run's: its verdict fails naming the
field, and a proof always starts from the run's init, never from a differing step's config.
"""

import hashlib
import json

from checkpointing.errors import CheckpointError
from checkpointing.workdir import read_manifest


def fixed_hash(fixed_fields: dict) -> str:
    """The hash a manifest records for its fixed fields (checkpointing/service.py RunMetadata.of_run)."""
    return hashlib.sha256(json.dumps(fixed_fields, sort_keys=True).encode()).hexdigest()[:16]


def inconsistency(manifest: dict) -> str | None:
    """What is wrong inside one manifest's identity on its own, or None."""
    config, fixed = manifest["config"], manifest["fixed_fields"]
    for name in sorted(fixed):
        if name not in config:
            return f"its config has no field {name!r}, a fixed field"
        if config[name] != fixed[name] or type(config[name]) is not type(fixed[name]):
            return f"its config's {name} is {config[name]!r}, its fixed field {fixed[name]!r}"
    try:
        if fixed_hash(fixed) != manifest["fixed_hash"]:
            return "its fixed_fields do not hash to its fixed_hash"
    except TypeError as err:
        return f"its fixed_fields are not JSON ({err})"
    return None


def run_manifest(workdir: str, committed: list[int]) -> dict | None:
    """The manifest that names the run (its oldest consistent committed step's), or None."""
    for step in committed:
        try:
            manifest = read_manifest(workdir, step)
        except CheckpointError:
            continue
        if inconsistency(manifest) is None:
            return manifest
    return None


def difference(step: int, manifest: dict, run: dict | None) -> str | None:
    """Why `step` (its `manifest`) is not the run's, naming the field; None if it is."""
    problem = inconsistency(manifest)
    if problem is not None:
        return f"step {step} manifest is damaged: {problem}"
    if run is None or run is manifest:
        return None
    origin = f"the run of step {run['step']}"
    saved, own = run["fixed_fields"], manifest["fixed_fields"]
    differing = sorted(name for name in set(saved) | set(own) if saved.get(name) != own.get(name))
    if differing or manifest["fixed_hash"] != run["fixed_hash"]:
        details = ", ".join(f"{name} {own.get(name)!r} vs {saved.get(name)!r} in {origin}" for name in differing)
        return f"step {step} is not this run's: its fixed config differs ({details or 'fixed_hash'})"
    unknown = sorted(set(manifest["config"]) - set(run["config"]))
    if unknown:
        return f"step {step} is not this run's: unknown config field(s) {', '.join(map(repr, unknown))}"
    for field in ("program", "init_from"):
        if manifest.get(field) != run.get(field):
            return (f"step {step} is not this run's: its {field} {manifest.get(field)!r} vs {run.get(field)!r} "
                    f"in {origin}")
    return None



def init_origin(manifest: dict) -> str:
    """What a proof from the run's start replays from: the config's init, or the params it imported."""
    source = manifest.get("init_from")
    return "the config's init" if not source else f"the params of step {source['step']} of {source['workdir']}"
