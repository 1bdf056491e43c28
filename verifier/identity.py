"""Which run a workdir holds, and whether a step belongs to it.

The run's identity (its fixed config, the fields and their hash; its program; the init_from it started
from) comes from the run's own record, `<workdir>/run.json`, written once at its first start
(checkpointing/_src/run_record.py). A workdir from before that record has none: its identity is then the one
most of its committed, consistent manifests share (consistent: the config's fixed fields are the recorded
fixed_fields and hash to the fixed_hash); a tie goes to the identity of the newest such step, the run a
relaunch continues (the trainer checks a relaunch's config against its newest step). Either way a foreign
step (another seed, another learning rate, another program or origin) is not this run's wherever it lies,
oldest or not: its verdict fails naming the field, and a proof always starts from the run's init, never
from a differing step's config. Fields outside the fixed config may come and go between steps (a version
that records a new one); a fixed field a manifest's own config contradicts is damage.
"""

import hashlib
import json
from collections import Counter

from absl import logging

from checkpointing.verification import run_record
from checkpointing.errors import CheckpointError, ManifestError
from checkpointing.verification import read_manifest

RECORD = "the run's record (run.json)"


def fixed_hash(fixed_fields: dict) -> str:
    """The hash a manifest records for its fixed fields (checkpointing/_src/run_metadata.py RunMetadata.of_run)."""
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


def run_identity(workdir: str, committed: list[int]) -> dict | None:
    """The run's identity: {fixed_fields, fixed_hash, program, init_from, origin} from its record, else
    the one most consistent manifests share (module docstring); None if neither exists. Read only: the
    verifier never writes the record."""
    try:
        record = run_record.read(workdir)
    except ManifestError as err:
        logging.warning("%s; the run's identity is the one most of its steps share", err)
        record = None
    if record is not None and not run_record.disowned_by_steps(workdir, record):
        return {**{field: record[field] for field in run_record.IDENTITY_FIELDS}, "origin": RECORD}
    if record is not None:  # the record is the suspect, not the steps: never their final fails
        logging.warning("%s records another run than every committed step (a copied run.json?): the run's "
                        "identity is the one most of its steps share", RECORD)
    return _shared_by_most(workdir, committed)


def _shared_by_most(workdir: str, committed: list[int]) -> dict | None:
    steps_of: dict[str, list[int]] = {}
    identities: dict[str, dict] = {}
    for step in committed:
        try:
            manifest = read_manifest(workdir, step)
        except CheckpointError:
            continue
        if inconsistency(manifest) is not None:
            continue
        found = {field: manifest.get(field) for field in run_record.IDENTITY_FIELDS}
        key = json.dumps(found, sort_keys=True)
        identities.setdefault(key, found)
        steps_of.setdefault(key, []).append(step)
    if not steps_of:
        return None
    counts = Counter({key: len(steps) for key, steps in steps_of.items()})
    chosen = max(counts, key=lambda key: (counts[key], max(steps_of[key])))  # most steps; a tie: the newest step
    steps = steps_of[chosen]
    origin = f"the run of step {steps[0]}" if len(steps) == 1 else (
        f"the run of steps {steps[0]}..{steps[-1]} ({len(steps)} of {sum(counts.values())} steps)")
    return {**identities[chosen], "origin": origin}


def difference(step: int, manifest: dict, run: dict | None) -> str | None:
    """Why `step` (its `manifest`) is not the run's (`run`: run_identity()), naming the field; None if it is."""
    problem = inconsistency(manifest)
    if problem is not None:
        return f"step {step} manifest is damaged: {problem}"
    if run is None:
        return None
    origin = run["origin"]
    saved, own = run["fixed_fields"], manifest["fixed_fields"]
    differing = sorted(name for name in set(saved) | set(own) if saved.get(name) != own.get(name))
    if differing or manifest["fixed_hash"] != run["fixed_hash"]:
        details = ", ".join(f"{name} {own.get(name)!r} vs {saved.get(name)!r} in {origin}" for name in differing)
        return f"step {step} is not this run's: its fixed config differs ({details or 'fixed_hash'})"
    for field in ("program", "init_from"):
        if manifest.get(field) != run.get(field):
            return (f"step {step} is not this run's: its {field} {manifest.get(field)!r} vs {run.get(field)!r} "
                    f"in {origin}")
    return None


def init_origin(manifest: dict) -> str:
    """What a proof from the run's start replays from: the config's init, or the params it imported."""
    source = manifest.get("init_from")
    return "the config's init" if not source else f"the params of step {source['step']} of {source['workdir']}"
