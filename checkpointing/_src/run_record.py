"""The run's own record of which run a workdir holds: `<workdir>/run.json`.

Process 0 writes it once, at the run's first start (a fresh start: after taking the lease, before the
first save), durably (checkpointing/_src/durable.py), and never rewrites it. A relaunch whose identity differs
is refused before anything is written; only a deliberate start over (--resume_from=none --rollback)
moves it to superseded/ with the steps and records the new run. The verifier reads it to know the run
(verifier/identity.py): a step whose identity differs from it is not this run's, whatever its position;
it never writes it. A workdir from before the record has none: the verifier then takes the identity
most of its manifests share.

Fields: format; fixed_fields and fixed_hash (the config a resume must not change); program (what the
verifier replays it with, null: the run names none); init_from (null, or the other run's step its params
came from); digest (sha256 of the other fields' canonical JSON: a damaged record is not trusted).
"""

import hashlib
import json
import time

from absl import logging

from checkpointing._src import durable
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CheckpointError, ConfigMismatchError, ManifestError, one_line_cause
from checkpointing._src.run_metadata import RunMetadata

FORMAT = 1
IDENTITY_FIELDS = ("fixed_fields", "fixed_hash", "program", "init_from")


def of_run(run: RunMetadata) -> dict:
    """The record of `run`: its identity fields and their digest."""
    record = {"format": FORMAT, "fixed_fields": run.fixed_fields, "fixed_hash": run.fixed_hash,
              "program": run.program, "init_from": run.init_from}
    return {**record, "digest": _digest(record)}


def _digest(record: dict) -> str:
    content = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read(workdir: str) -> dict | None:
    """The workdir's record, None if it has none; ManifestError if it is damaged (not JSON, a field
    missing or of the wrong type, its digest)."""
    path = workdir_lib.run_file(workdir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path}: not valid JSON ({err})") from None
    if not (isinstance(record, dict) and isinstance(record.get("fixed_fields"), dict)
            and isinstance(record.get("fixed_hash"), str) and isinstance(record.get("program"), (str, type(None)))
            and isinstance(record.get("init_from"), (dict, type(None)))):
        raise ManifestError(f"{path}: not a run record (fixed_fields, fixed_hash, program, init_from)")
    if record.get("digest") != _digest(record):
        raise ManifestError(f"{path}: content does not match its digest (edited or damaged after it was written)")
    return record


def differences(record: dict, run: RunMetadata) -> list[str]:
    """What differs between the recorded run and `run`, each as 'name recorded vs this run's' ([]: none),
    compared as the JSON they are recorded as (a tuple and a list alike)."""
    fixed, own = record["fixed_fields"], run.fixed_fields
    found = [f"{name} {fixed.get(name)!r} vs {own.get(name)!r}" for name in sorted(set(fixed) | set(own))
             if _canonical(fixed.get(name)) != _canonical(own.get(name))]
    if not found and record["fixed_hash"] != run.fixed_hash:
        found.append(f"fixed_hash {record['fixed_hash']} vs {run.fixed_hash}")
    found += [f"{name} {record[name]!r} vs {getattr(run, name)!r}" for name in ("program", "init_from")
              if _canonical(record[name]) != _canonical(getattr(run, name))]
    return found


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


def check(workdir: str, run: RunMetadata, *, starting_over: bool) -> None:
    """A relaunch must be the recorded run (ConfigMismatchError naming what differs), unless it starts
    the workdir over. Read only: a refused run changes nothing. A damaged record is warned about."""
    try:
        record = read(workdir)
    except ManifestError as err:
        logging.warning("the run's record is damaged (%s); it is left as it is", err)
        return
    if record is None or starting_over:
        return
    found = differences(record, run)
    if found and disowned_by_steps(workdir, record):
        # A record no committed step agrees with is the suspect (a run.json copied from another run's
        # folder), not the steps: a training job is never left unable to resume by one file.
        logging.warning("%s records another run than every committed step (%s): it is left as it is and the "
                        "steps decide", workdir_lib.run_file(workdir), ", ".join(found))
        return
    if found:
        raise ConfigMismatchError(f"{workdir_lib.run_file(workdir)} records another run than this one "
                                  f"({', '.join(found)}): use a new --workdir, or --resume_from=none --rollback to "
                                  "start this workdir over")


def identity_of(manifest_or_record: dict) -> str:
    """The identity fields of a manifest or a record, as canonical JSON: equal strings, the same run."""
    return _canonical({field: manifest_or_record.get(field) for field in IDENTITY_FIELDS})


def disowned_by_steps(workdir: str, record: dict) -> bool:
    """Whether the workdir holds committed steps and none of the readable ones records `record`'s identity."""
    mine, readable = identity_of(record), 0
    for step in workdir_lib.committed_steps(workdir):
        try:
            manifest = workdir_lib.read_manifest(workdir, step)
        except CheckpointError:
            continue
        readable += 1
        if identity_of(manifest) == mine:
            return False
    return readable > 0


def record_first_start(workdir: str, run: RunMetadata, *, starting_over: bool) -> None:
    """Process 0 at a fresh start: writes the record unless there is one (a start over first moves the
    old one to superseded/). Durable on a local disk before the first save can commit."""
    path = workdir_lib.run_file(workdir)
    try:
        if path.exists():
            if not starting_over:
                return
            superseded = workdir_lib.superseded_dir(workdir)
            durable.make_dirs(superseded)
            path.rename(superseded / f"run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json")
        text = json.dumps(of_run(run), indent=1, sort_keys=True)
        if durable.is_local(path):
            durable.write_text(path, text)
        else:
            path.write_text(text)  # a GCS object appears whole or not at all, durable once written
    except OSError as err:
        raise CheckpointError(f"the run's record: cannot write {path}: {one_line_cause(err)}") from err
    logging.info("recorded the run's identity in %s", path)
