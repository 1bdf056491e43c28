"""Verdicts: what the verifier proved about each step, one small JSON per step.

Written atomically (a whole file appears or none: rename on a local disk, a single object write on
gs://) under `<workdir>/verdicts/<step>.json`, and schema-checked on read like manifests.

Fields:
  step                     int
  level                    "intact" (restored on another mesh, every fingerprint equal) or
                           "reproducible" (also: replayed steps match the successor's recorded losses)
  status                   "pass", "fail" or "gone" (deleted by retention while being verified)
  detail                   one line: what was checked, or what is wrong (the first mismatch, both values)
  mismatch                 null, or {"kind", "where", "expected", "actual"} of the first mismatch
  max_relative_difference  float or null: largest relative loss difference of the replay
  replayed_steps           int; successor: int or null (the step whose losses the replay was compared with)
  checkpoint_mesh, verifier_mesh   {"axis": size}
  durations_secs           {"restore": float, "replay": float, ...}
  verified_at              ISO-8601 UTC
"""

import datetime
import json
import os
import uuid

from etils import epath

from checkpointing.errors import ManifestError
from checkpointing.paths import fresh_path

VERDICTS_DIR = "verdicts"
LEVELS = ("intact", "reproducible")
STATUSES = ("pass", "fail", "gone")

_REQUIRED = {
    "step": int, "level": str, "status": str, "detail": str, "replayed_steps": int,
    "checkpoint_mesh": dict, "verifier_mesh": dict, "durations_secs": dict, "verified_at": str,
}


def verdict_path(workdir: str, step: int) -> epath.Path:
    return epath.Path(workdir) / VERDICTS_DIR / f"{step}.json"


def make(*, step: int, level: str, status: str, detail: str, checkpoint_mesh: dict, verifier_mesh: dict,
         durations_secs: dict, mismatch: dict | None = None, max_relative_difference: float | None = None,
         replayed_steps: int = 0, successor: int | None = None) -> dict:
    verdict = {
        "step": step, "level": level, "status": status, "detail": detail, "mismatch": mismatch,
        "max_relative_difference": max_relative_difference, "replayed_steps": replayed_steps,
        "successor": successor, "checkpoint_mesh": checkpoint_mesh, "verifier_mesh": verifier_mesh,
        "durations_secs": {k: round(v, 4) for k, v in durations_secs.items()},
        "verified_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return validate(verdict)


def validate(verdict, where: str = "verdict") -> dict:
    if not isinstance(verdict, dict):
        raise ManifestError(f"{where}: not a JSON object")
    for field, kind in _REQUIRED.items():
        if not isinstance(verdict.get(field), kind) or isinstance(verdict.get(field), bool):
            raise ManifestError(f"{where}: field {field!r} must be {kind.__name__}")
    if verdict["level"] not in LEVELS or verdict["status"] not in STATUSES:
        raise ManifestError(f"{where}: bad level/status {verdict['level']!r}/{verdict['status']!r}")
    return verdict


def write(workdir: str, verdict: dict) -> None:
    """Writes the verdict so that readers see the old file or the new one, never a part."""
    path = verdict_path(workdir, verdict["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(verdict, indent=1, sort_keys=True)
    if str(path).startswith("gs://"):
        path.write_text(text)  # a GCS object appears whole or not at all
        return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


def read(workdir: str, step: int) -> dict | None:
    path = verdict_path(workdir, step)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return validate(json.loads(text), f"verdict of step {step}")
    except json.JSONDecodeError as err:
        raise ManifestError(f"verdict of step {step}: not valid JSON ({err})") from None


def read_all(workdir: str) -> dict[int, dict]:
    directory = fresh_path(workdir) / VERDICTS_DIR
    if not directory.exists():
        return {}
    steps = sorted(int(p.name[:-5]) for p in directory.iterdir() if p.name.endswith(".json") and p.name[:-5].isdigit())
    return {step: verdict for step in steps if (verdict := read(workdir, step)) is not None}


def passed_steps(workdir: str) -> list[int]:
    """Steps whose verdict passed (at any level), ascending."""
    return [step for step, verdict in read_all(workdir).items() if verdict["status"] == "pass"]


def newest_verified_step(workdir: str) -> int | None:
    steps = passed_steps(workdir)
    return steps[-1] if steps else None


def summary(verdict: dict | None) -> str:
    return "-" if verdict is None else f"{verdict['level']} {verdict['status']}"
