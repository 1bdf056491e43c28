"""The loop's losses: kept on device until the log cadence, then pulled in one transfer and appended
to `metrics.jsonl` (process 0, local workdirs), each line tagged with this attempt's number, and to
TensorBoard's event file (trainer/event_files.py) at the same time.

The file's format, and how a run's history is read back across attempts and retention, is
checkpointing/_src/history.py's (docs/training.md#step-numbering).
"""

import json
import os

import jax
from absl import logging

from checkpointing.config import is_object_store
from checkpointing.inspection import attempt_record, last_attempt_id, metrics_file
from checkpointing.errors import one_line_cause
from trainer.metrics import RunMetrics


class LossLog:
    """Per-step losses kept on device until the log cadence, then pulled in one transfer.

    `attempt` ({"resumed_from", "tier", "layout"}: where this start of the job began) opens a new
    attempt in metrics.jsonl; without it (a benchmark, a test) lines carry no attempt number."""

    def __init__(self, workdir: str, attempt: dict | None = None):
        self._pending: list[tuple[int, jax.Array, dict]] = []
        self.losses: dict[int, float] = {}
        self.scalars: dict[int, dict[str, float]] = {}  # the step's grad_norm, param_norm, learning_rate
        primary = jax.process_index() == 0
        self._metrics_path = metrics_file(workdir) if primary and not is_object_store(workdir) else None
        resumed_from = attempt["resumed_from"] if attempt is not None else None
        self.metrics = RunMetrics(workdir, resumed_from) if primary else None  # TensorBoard + progress
        self.attempt: int | None = None
        if self._metrics_path and attempt is not None:
            self.attempt = last_attempt_id(workdir) + 1
            self._append([attempt_record(self.attempt, **attempt)], "the attempt's first line")

    def add(self, step: int, loss: jax.Array, scalars: dict | None = None) -> None:
        self._pending.append((step, loss, scalars or {}))

    def flush(self) -> dict[int, float]:
        """Pulls pending losses to the host (one sync) and appends them to the metrics file and to
        TensorBoard's events, the two at once (at the log cadence and at a preemption alike)."""
        if not self._pending:
            return {}
        values, scalars = jax.device_get(([loss for _, loss, _ in self._pending], [s for _, _, s in self._pending]))
        fresh = {step: float(value) for (step, _, _), value in zip(self._pending, values)}
        self.scalars = {step: {k: float(v) for k, v in s.items()} for (step, _, _), s in zip(self._pending, scalars)}
        self._pending.clear()
        self.losses.update(fresh)
        self._append([{"step": s, "loss": v, **self.scalars[s], **self._tag()} for s, v in fresh.items()],
                     f"steps {min(fresh)}..{max(fresh)}")
        if self.metrics is not None:
            self.metrics.record_losses(fresh, self.scalars)
        return fresh

    def record_eval(self, step: int, values: dict[str, float]) -> None:
        """The eval numbers of the state at `step` (no "loss" key: readers of losses skip the line)."""
        self._append([{"step": step, **values, **self._tag()}], f"the eval of step {step}")

    def _tag(self) -> dict:
        return {} if self.attempt is None else {"attempt": self.attempt}

    def _append(self, records: list[dict], what: str) -> None:
        if not self._metrics_path:
            return
        data = "".join(json.dumps(record) + "\n" for record in records).encode()
        try:
            with open(self._metrics_path, "ab", buffering=0) as f:
                start = f.seek(0, os.SEEK_END)
                try:
                    while data:
                        data = data[f.write(data):]
                except OSError:
                    f.truncate(start)  # no half line: the file stays one JSON record per line
                    raise
        except OSError as err:
            # Metrics are a convenience copy: every loss is also recorded in the next checkpoint's
            # manifest, and a full disk fails that save with its own line. So warn and train on.
            logging.log_every_n_seconds(
                logging.WARNING, "metrics: cannot append %s to %s (%s); training goes on, "
                "the checkpoints' manifests record every loss", 600, what, self._metrics_path,
                one_line_cause(err))


def read_metrics(workdir: str) -> dict[int, float]:
    """The metrics file as {step: loss}; a step logged twice (after a resume) keeps its last value.
    Lines without a loss (an attempt's opening line, an eval) are skipped."""
    losses = {}
    with open(metrics_file(workdir)) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                losses[record["step"]] = record["loss"]
    return losses
