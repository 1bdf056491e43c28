"""Verdicts: what the verifier proved about each step, one small JSON per step.

Written atomically (a whole file appears or none: rename on a local disk, a single object write on
gs://) under `<workdir>/verdicts/<step>.json`, and schema-checked on read like manifests. A damaged
file (half a file after a power loss) counts as no verdict, with one warning: a reader's file never
stops the writer, and the verifier writes it again.

Levels, weakest first (each includes the ones before it):
  intact      the step restored onto the verifier's mesh: its manifest matches its digest, every
              leaf's fingerprint equals the manifest's, every leaf and recorded loss is finite and
              the step counter equals the step
  replayed    a replay from a proved predecessor matched the losses this step recorded for
              the replayed steps, but stopped short of the step (--replay_steps < the distance):
              the step's own state is not proved
  resumes     the cheap proof: the few steps the trainer recorded after this save (its probe,
              checkpointing/_src/probes.py), replayed from the checkpoint, give the trainer's losses and
              per-leaf sums and norms: the checkpoint resumes the run it came from
  reproduced  the full proof: a replay from the newest proved predecessor (or the config's init,
              for the first checkpoint) reached this step with every loss it recorded and its whole
              state equal: value for value on the layout and platform that recorded it, within the noise
              of a layout change the verifier measured for that interval on another (verifier/evidence.py).
  Proved steps (resumes or reproduced, passed) anchor later proofs, `--resume_from=latest_verified`
  and retention's protection: both show that the checkpoint resumes the run.

Fields:
  step, level, status     "pass"; "fail" (evidence: the step is wrong); "inconclusive" (the proof could
                          not decide, its reason in detail: never proved); "error" (a fault of the
                          verifier's own: its program, memory, devices, storage; never the checkpoint's,
                          written with complete=false, so the next verifier run retries it); "gone"
                          (deleted while being verified). verifier/faults.py says which is which.
  complete                 false while a replay is still to come (the intact part is written first), and
                          for an error; a complete verdict is final for its save (write(): --reverify)
  interrupted              optional, true: the verifier stopped (SIGINT, SIGTERM) before this intact verdict's
                          replay ended; nothing is replaying it, and the next verifier run redoes it
  detail                   one line: what was proved, or the first mismatch with both values
  mismatch                 null, or {"kind", "where", "expected", "actual"} of the first mismatch
  max_relative_difference  float or null: the largest relative loss difference of the replay
  replayed_from            null, or the step the replay started from (0: the config's init)
  replayed_steps, compared_losses   int
  manifest_digest          the digest of the manifest proved (a verdict belongs to one save)
  checkpoint_mesh, verifier_mesh   {"axis": size}
  durations_secs           {"restore": float, "replay": float, ...}
  content_sha256           in a passing verdict that proves its step: {key path: sha256 of the leaf's values}
                           (checkpointing/_src/content.py), what a restore trusting the verdict checks
  evidence                 across layouts (verifier/evidence.py): {"ratio": the largest distance / measured
                           noise (of the evidence, for a failure), "margin", "deciding": quantities that could
                           decide, "chaotic": leaves that could not, "replays": layouts replayed on};
                           absent where the proof was bit-exact
  verified_at              ISO-8601 UTC
"""

import datetime
import json

from absl import logging

from checkpointing._src import durable
from checkpointing.errors import CheckpointError, ManifestError, one_line_cause
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import fresh_path

_WARNED: set[str] = set()  # the damaged verdict files this process has warned about

LEVELS = ("intact", "replayed", "resumes", "reproduced")
STATUSES = ("pass", "fail", "inconclusive", "error", "gone")

_REQUIRED = {
    "step": int, "level": str, "status": str, "complete": bool, "detail": str, "replayed_steps": int,
    "compared_losses": int, "checkpoint_mesh": dict, "verifier_mesh": dict, "durations_secs": dict,
    "verified_at": str,
}


def make(*, step: int, level: str, status: str, detail: str, checkpoint_mesh: dict, verifier_mesh: dict,
         durations_secs: dict, complete: bool = True, mismatch: dict | None = None,
         max_relative_difference: float | None = None, replayed_from: int | None = None, replayed_steps: int = 0,
         compared_losses: int = 0, manifest_digest: str | None = None, evidence: dict | None = None) -> dict:
    verdict = {
        "step": step, "level": level, "status": status, "complete": complete, "detail": detail,
        "mismatch": mismatch, "max_relative_difference": max_relative_difference,
        "replayed_from": replayed_from, "replayed_steps": replayed_steps, "compared_losses": compared_losses,
        "manifest_digest": manifest_digest, "checkpoint_mesh": checkpoint_mesh, "verifier_mesh": verifier_mesh,
        "durations_secs": {k: round(v, 4) for k, v in durations_secs.items()},
        "verified_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if evidence is not None:
        verdict["evidence"] = evidence
    return validate(verdict)


def validate(verdict, where: str = "verdict") -> dict:
    if not isinstance(verdict, dict):
        raise ManifestError(f"{where}: not a JSON object")
    for field, kind in _REQUIRED.items():
        if not isinstance(verdict.get(field), kind) or isinstance(verdict.get(field), bool) and kind is not bool:
            raise ManifestError(f"{where}: field {field!r} must be {kind.__name__}")
    if verdict["level"] not in LEVELS or verdict["status"] not in STATUSES:
        raise ManifestError(f"{where}: bad level/status {verdict['level']!r}/{verdict['status']!r}")
    return verdict


def write(workdir: str, verdict: dict, *, replace: bool = False) -> bool:
    """Writes the verdict so that readers see the old file (damaged or not) or the whole new one,
    and on a local disk durably (checkpointing/_src/durable.py: fsync, rename, fsync the directory).

    A complete verdict is final for its save: nothing is written over it for the same save (the same
    manifest digest, or a verdict that could not read one: a step being deleted reads as missing files)
    unless `replace` (--reverify), and then only by another complete verdict, so an `error` or an intact
    part never stands in for a verdict already reached. Returns whether it was written."""
    try:
        existing = read(workdir, verdict["step"])
    except OSError:  # unreadable: the write below says why if it cannot replace it either
        existing = None
    if _final_for(existing, verdict, replace):
        return False
    path = workdir_lib.verdict_file(workdir, verdict["step"])
    text = json.dumps(verdict, indent=1, sort_keys=True)
    try:
        durable.make_dirs(path.parent)
        if durable.is_local(path):
            durable.write_text(path, text)  # a full disk removes its tmp file
        else:
            path.write_text(text)  # a GCS object appears whole or not at all, durable once written
    except OSError as err:
        raise CheckpointError(f"verdict of step {verdict['step']}: cannot write {path}: {one_line_cause(err)}") from err
    return True


def _final_for(existing: dict | None, verdict: dict, replace: bool) -> bool:
    """Whether `existing` is a complete verdict of the same save that `verdict` may not replace."""
    if existing is None or not existing["complete"]:
        return False
    same_save = verdict["manifest_digest"] is None or verdict["manifest_digest"] == existing.get("manifest_digest")
    return same_save and not (replace and verdict["complete"])


def load(workdir: str, step: int) -> tuple[dict | None, str | None]:
    """(the verdict, None); (None, None) if the step has none; (None, why) if its file is damaged
    (half a file after a power loss, bytes that are not a verdict). The one place verdicts are parsed."""
    path = workdir_lib.verdict_file(workdir, step)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        return validate(json.loads(data.decode()), f"verdict of step {step}"), None
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err})"
    except ManifestError as err:
        return None, str(err).removeprefix(f"verdict of step {step}: ")


def read(workdir: str, step: int) -> dict | None:
    """The step's verdict, or None if it has none. A damaged verdict is a reader's file and never
    stops anyone (retention, latest_verified, the verifier, inspect): it counts as no verdict, so
    the step is unproved until the verifier writes it again, and it is warned about once."""
    verdict, damage = load(workdir, step)
    if damage is not None:
        path = str(workdir_lib.verdict_file(workdir, step))
        if path not in _WARNED:
            _WARNED.add(path)
            logging.warning("verdict of step %d is damaged: %s: %s; the step counts as unproved until the verifier "
                            "proves it again", step, path, damage)
    return verdict


def read_steps(workdir: str, steps) -> dict[int, dict]:
    """The verdicts of just these steps (those that have one): one read each, no listing.

    Callers that know which steps matter (the committed ones) read only those, not every verdict
    a long run ever wrote (on gs:// each read is a request).
    """
    return {step: verdict for step in sorted(steps) if (verdict := read(workdir, step)) is not None}


def read_all(workdir: str) -> dict[int, dict]:
    fresh_path(workdir)
    directory = workdir_lib.verdicts_dir(workdir)
    if not directory.exists():
        return {}
    steps = sorted(int(p.name[:-5]) for p in directory.iterdir() if p.name.endswith(".json") and p.name[:-5].isdigit())
    return {step: verdict for step in steps if (verdict := read(workdir, step)) is not None}


def digest_on_disk(workdir: str, step: int) -> str | None:
    """The digest of `step`'s manifest as it is on disk now; None if it has none or cannot be read
    (a verdict on such a step, written with no digest, still belongs to it)."""
    try:
        return workdir_lib.read_manifest(workdir, step).get("digest")
    except CheckpointError:
        return None


def belongs(verdict: dict | None, digest: str | None) -> bool:
    """Whether `verdict` is about the save whose manifest digest is `digest` (a step replaced after
    it was proved keeps a verdict about another save: it counts as none)."""
    return verdict is not None and verdict.get("manifest_digest") == digest


def for_save(workdir: str, step: int, digest: str | None = None) -> dict | None:
    """The verdict of the save of `step` on disk (its manifest's digest, read unless given), or None:
    the one check every user of a verdict makes (the verifier, resumes, retention, inspect)."""
    verdict = read(workdir, step)
    if verdict is None:
        return None
    return verdict if belongs(verdict, digest if digest is not None else digest_on_disk(workdir, step)) else None


def current_steps(workdir: str, steps) -> dict[int, dict]:
    """read_steps(), keeping only the verdicts that belong to the step's save on disk."""
    return {step: verdict for step, verdict in read_steps(workdir, steps).items()
            if belongs(verdict, digest_on_disk(workdir, step))}


PROVED_LEVELS = ("resumes", "reproduced")


def is_proved(verdict: dict | None) -> bool:
    """Whether a verdict proves that its step resumes the run (the only kind a resume or a proof may start
    from): the cheap proof or the full one, passed, bound to the content it proved (its leaves' sha256,
    checkpointing/_src/content.py). A proving verdict without them proves nothing: the arrays behind it
    could be any whose fingerprints match."""
    return (verdict is not None and verdict["level"] in PROVED_LEVELS and verdict["status"] == "pass"
            and bool(verdict.get("content_sha256")))


def proved_steps(workdir: str, among) -> list[int]:
    """Which of the steps `among` (e.g. the committed ones) are proved, ascending; a verdict counts
    only for the save it names (its manifest digest)."""
    return [step for step, verdict in current_steps(workdir, among).items() if is_proved(verdict)]


def newest_proved_step(workdir: str, among) -> int | None:
    """The newest of `among` that is proved: proved_steps()[-1], read from the newest step down and stopped at
    the first proved one. Retention asks at every save, inside save(), and the progress line every few
    seconds; on gs:// each read is a request. A verifier that keeps pace proves one of the newest two: one or
    two reads. Past them, one listing of the verdicts says which older steps have one to read, so a run whose
    verifier is behind or not running (with 100 kept milestones: 100 reads a save) pays one listing."""
    newest_first = sorted(among, reverse=True)
    for step in newest_first[:_READS_BEFORE_LISTING]:
        if is_proved(for_save(workdir, step)):
            return step
    older = newest_first[_READS_BEFORE_LISTING:]
    listed = _steps_with_verdicts(workdir) if older else set()
    for step in older:
        if step in listed and is_proved(for_save(workdir, step)):
            return step
    return None


# The newest steps read before listing the verdicts: where a verifier keeps pace, one of them is proved.
_READS_BEFORE_LISTING = 2


def _steps_with_verdicts(workdir: str) -> set[int]:
    """The steps with a verdict file (one listing; a verdict written after it counts at the next ask)."""
    fresh_path(workdir)  # gcsfs's cached listing would hide the verifier's newer verdicts
    directory = workdir_lib.verdicts_dir(workdir)
    try:
        names = [path.name for path in directory.iterdir()]
    except FileNotFoundError:  # no verdict yet
        return set()
    return {int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit()}


def describe(workdir: str, step: int) -> str:
    """inspect's verdict column: summary(), or "damaged" when the file cannot be read as a verdict."""
    verdict, damage = load(workdir, step)
    if damage is not None:
        return "damaged (unproved)"
    if verdict is not None:
        digest = digest_on_disk(workdir, step)
        if not belongs(verdict, digest):
            return "stale: another save (unproved)" if digest is not None else "manifest unreadable (unproved)"
    return summary(verdict)


def summary(verdict: dict | None) -> str:
    """'reproduced pass', 'intact pass (replaying)', 'intact pass (interrupted)' (the verifier stopped before
    its replay ended), 'intact error' (never replaying: the next verifier run retries it)."""
    if verdict is None:
        return "-"
    if verdict["complete"] or verdict["status"] == "error":
        return f"{verdict['level']} {verdict['status']}"
    return f"{verdict['level']} {verdict['status']}" + (" (interrupted)" if verdict.get("interrupted") else
                                                        " (replaying)")
