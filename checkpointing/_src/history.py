"""A run's whole loss history, across its attempts: `metrics.jsonl` and the committed manifests.

Numbering (docs/training.md#step-numbering): step `s` is the state's step counter. The loss of
step s is the one computed by the update that takes the counter from s to s + 1, so a fresh run's
first loss is step 0's and checkpoint N (the state at counter N) holds losses of steps below N.
The eval loss of step N is that of the state at counter N: the params step N's update starts from.

Retention deletes old checkpoints, and their manifests' losses with them; `metrics.jsonl` keeps
every attempt. Process 0 appends it (local workdirs only) at the log cadence and at a preemption:

  {"attempt": 3, "resumed_from": 39, "tier": "persistent", "layout": "data=8 (4 processes)"}
  {"step": 39, "loss": 0.53, "attempt": 3, "grad_norm": 2.1, ...}     the loss of step 39
  {"step": 40, "eval_loss": 2.97, "attempt": 3, ...}                  the eval of the state at step 40

The first line of an attempt says where it started. Files written before attempts were recorded
(lines without "attempt") still read: there a line whose step is not past the previous line's
starts a new attempt.

The history of a step is a committed manifest's loss where one holds it, else the latest
attempt's in `metrics.jsonl`. A committed manifest is always the latest attempt's value: a
resume starts at the newest committed step (a rollback moves newer ones aside), so no later
attempt recomputes a step that a committed manifest holds.
"""

import dataclasses
import json
from collections.abc import Iterable

from etils import epath

from checkpointing._src import manifest as manifest_lib
from checkpointing.config import format_mesh, is_object_store
from checkpointing._src.workdir import committed_steps, metrics_file, read_manifest


@dataclasses.dataclass
class Attempt:
    """One start of the job (a process group), in the order the attempts ran."""

    number: int  # 1, 2, ...
    resumed_from: int | None  # the step it started at (0: fresh); None where the file does not say
    tier: str | None  # "persistent", "local", or None (fresh, or not recorded)
    layout: str | None  # "data=4,model=2 (2 processes)"
    steps: list[int] = dataclasses.field(default_factory=list)  # the steps whose losses it recorded
    losses: list[float] = dataclasses.field(default_factory=list)

    @property
    def first_step(self) -> int | None:
        return self.resumed_from if self.resumed_from is not None else (self.steps[0] if self.steps else None)

    @property
    def last_step(self) -> int | None:
        return self.steps[-1] if self.steps else None

    @property
    def reached(self) -> int | None:
        """The step counter its own records show it reached: its last recorded loss's step + 1 (that update
        was done), or where it started if it recorded none."""
        return self.last_step + 1 if self.steps else self.first_step


@dataclasses.dataclass
class History:
    losses: dict[int, float]  # {step: loss}, sorted by step, the latest attempt's
    attempts: list[Attempt]  # from metrics.jsonl; from the manifests' resumed_from where it records none
    evals: dict[int, dict[str, float]]  # {step: {"eval_loss": ..., ...}}, sorted by step


def layout_of(mesh: dict, process_count: int) -> str:
    return f"{format_mesh(mesh)} ({process_count} processes)"


def attempt_record(number: int, resumed_from: int, tier: str | None, layout: str) -> dict:
    """The line that opens an attempt in metrics.jsonl (trainer/loop.py writes it)."""
    return {"attempt": number, "resumed_from": resumed_from, "tier": tier, "layout": layout}


def parse_metrics(lines: Iterable[str]) -> tuple[list[Attempt], dict[int, dict[str, float]]]:
    """metrics.jsonl's lines -> (attempts in order, {step: eval values} with the latest attempt's).

    A line that is not a JSON object is skipped: the file is a convenience copy, and a damaged
    line must not hide the rest of the history."""
    attempts: list[Attempt] = []
    evals: dict[int, dict[str, float]] = {}
    current_id = None

    def open_attempt(record: dict) -> Attempt:
        attempt = Attempt(len(attempts) + 1, record.get("resumed_from"), record.get("tier"), record.get("layout"))
        attempts.append(attempt)
        return attempt

    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "step" not in record:  # an attempt's opening line
            if "attempt" in record:
                open_attempt(record)
                current_id = record["attempt"]
            continue
        step = int(record["step"])
        if "loss" not in record:  # an eval line
            values = {k: float(v) for k, v in record.items() if k.startswith("eval_")}
            if values:
                evals[step] = values
            continue
        written_id = record.get("attempt")
        last = attempts[-1] if attempts else None
        new = (last is None or written_id != current_id
               or (written_id is None and last.steps and step <= last.steps[-1]))
        if new:
            last = open_attempt({})
            current_id = written_id
        last.steps.append(step)
        last.losses.append(float(record["loss"]))
    return attempts, dict(sorted(evals.items()))


def last_attempt_id(workdir: str, tail_bytes: int = 65536) -> int:
    """The newest attempt number written to metrics.jsonl (0 if none): read from the file's tail only,
    so a long run's start-up does not read its whole history."""
    path = metrics_file(workdir)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - tail_bytes, 0))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(tail):
        try:
            number = json.loads(line).get("attempt")
        except (ValueError, AttributeError):
            continue
        if isinstance(number, int):
            return number
    return 0


def read_metrics_lines(workdir: str) -> list[str]:
    """metrics.jsonl's lines ([] where there is none: an object-store workdir, or nothing logged yet)."""
    if is_object_store(workdir):
        return []
    path = epath.Path(metrics_file(workdir))
    return path.read_text().splitlines() if path.exists() else []


def attempts_from_manifests(manifests: dict[int, dict]) -> list[Attempt]:
    """Attempts where metrics.jsonl has none (an object store): consecutive manifests that resumed from the same
    step belong to one attempt. A manifest's losses of steps before its attempt's start were computed by
    the attempt before (a resume from a local step carries them to the next persistent save): they are
    that attempt's records, so they show how far it got."""
    attempts: list[Attempt] = []
    previous_key = object()
    for step in sorted(manifests):
        manifest = manifests[step]
        resumed = (manifest.get("extra") or {}).get("resumed_from")
        key = (resumed or {}).get("step"), manifest["process_count"], json.dumps(manifest["mesh"], sort_keys=True)
        if key != previous_key:
            attempts.append(Attempt(len(attempts) + 1, resumed["step"] if resumed else 0,
                                    resumed["tier"] if resumed else None,
                                    layout_of(manifest["mesh"], manifest["process_count"])))
            previous_key = key
        for s, loss in sorted(manifest_lib.losses(manifest).items()):
            current = attempts[-1]
            before = attempts[-2] if len(attempts) > 1 and s < current.resumed_from else None
            owner = before if before is not None and (before.last_step is None or s > before.last_step) else current
            owner.steps.append(s)
            owner.losses.append(loss)
    return attempts


def read_history(workdir: str, manifests: dict[int, dict] | None = None) -> History:
    """The whole run's history (see the module docstring); `manifests` ({step: manifest} of the committed
    steps) when the caller has read them already."""
    if manifests is None:
        manifests = {step: read_manifest(workdir, step) for step in committed_steps(workdir)}
    attempts, evals = parse_metrics(read_metrics_lines(workdir))
    losses: dict[int, float] = {}
    for attempt in attempts:  # in order: a later attempt's value replaces an earlier one's
        losses.update(zip(attempt.steps, attempt.losses))
    for step in sorted(manifests):
        losses.update(manifest_lib.losses(manifests[step]))
        for at, values in ((manifests[step].get("extra") or {}).get("metrics") or {}).items():
            evals[int(at)] = {k: float(v) for k, v in values.items()}
    if not any(attempt.layout for attempt in attempts):  # none recorded (an object store, a file from before attempts)
        attempts = attempts_from_manifests(manifests) or attempts
    return History(dict(sorted(losses.items())), attempts, dict(sorted(evals.items())))
