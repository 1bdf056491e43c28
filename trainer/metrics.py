"""Metrics people can look at: TensorBoard scalars (trainer/event_files.py writes them) and one
progress line per log cadence.

Start-up phases are logged by process 0 as `phase <name> <seconds>s` (names in PHASES);
`parse_phases` reads them back from a log (the goodput benchmark does).
"""

import re
import time

import psutil
from absl import logging

from checkpointing.inspection import committed_steps, newest_proved_step, read_manifest
from checkpointing.config import is_object_store
from checkpointing.errors import one_line_cause
from trainer.event_files import EVAL_PREFIX, EventWriter

PHASES = ("process_start", "distributed_start", "open", "compile", "restore", "first_step")
PHASE_LINE = re.compile(r"\bphase (\w+) ([0-9.]+)s\b")
# The committed/verified steps are re-read at most this often (on an object store each read is a request).
STATUS_EVERY_SECS = {"local": 10.0, "object store": 60.0}


_PHASES_SEEN: dict[str, float] = {}  # this process's start-up phases, written with the first scalars


def record_phase(name: str, secs: float) -> None:
    """Keeps a start-up phase's duration for TensorBoard (`restart/<name>_secs`); the caller logs the line."""
    _PHASES_SEEN[name] = secs


def parse_phases(text: str) -> dict[str, float]:
    """{phase: seconds} from a log's `phase <name> <seconds>s` lines (the last of each name wins)."""
    return {name: float(secs) for name, secs in PHASE_LINE.findall(text) if name in PHASES}


def process_uptime_secs() -> float:
    return time.time() - psutil.Process().create_time()


class RunStatus:
    """The last committed and last reproduced step, re-read at most every STATUS_EVERY_SECS; a commit the
    trainer itself sees (saw_commit) shows at once.

    Cheap reads only: the checkpoint directory listing and the verdicts of committed steps.
    """

    def __init__(self, workdir: str):
        self._workdir = workdir
        self._read_at = -float("inf")
        self.committed: int | None = None
        self.verified: int | None = None
        self.preemptions = 0

    def refresh(self, force: bool = False) -> None:
        every = STATUS_EVERY_SECS["object store" if is_object_store(self._workdir) else "local"]
        if not force and time.monotonic() - self._read_at < every:
            return
        self._read_at = time.monotonic()
        try:
            steps = committed_steps(self._workdir)
            self.committed = steps[-1] if steps else None
            self.verified = newest_proved_step(self._workdir, steps)
        except Exception as err:  # a status line is not worth a crash
            logging.log_every_n_seconds(logging.WARNING, "metrics: cannot read the run's status in %s (%s)", 600,
                                        self._workdir, one_line_cause(err))

    def saw_commit(self, step: int) -> None:
        """This trainer saw its save of `step` commit: shown at once, not at the next re-read."""
        self.committed = step if self.committed is None else max(self.committed, step)

    def count_preemptions(self) -> None:
        """Preemption checkpoints among the committed ones (read once, at start-up)."""
        try:
            self.preemptions = sum(read_manifest(self._workdir, s)["reason"] == "preemption"
                                   for s in committed_steps(self._workdir))
        except Exception as err:
            logging.warning("metrics: cannot count preemptions in %s (%s)", self._workdir, one_line_cause(err))


def format_eta(secs: float) -> str:
    if not secs == secs or secs == float("inf"):  # NaN or no rate yet
        return "?"
    secs = int(round(secs))
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m" if secs >= 3600 else f"{secs // 60}m{secs % 60:02d}s"


def progress_line(step: int, total: int, loss: float, steps_per_sec: float, committed, verified,
                  throughput: dict | None = None) -> str:
    """`step` is the step whose loss is shown (the newest update's: counter step -> step + 1), so
    `step + 1` steps are done (docs/training.md#step-numbering)."""
    done = step + 1
    eta = (total - done) / steps_per_sec if steps_per_sec > 0 else float("inf")
    show = lambda s: "-" if s is None else str(s)
    line = (f"step {step} loss {loss:.6f} steps/s {steps_per_sec:.2f} progress {done}/{total} "
            f"({100.0 * done / max(total, 1):.0f}%) eta {format_eta(eta)} last committed {show(committed)} "
            f"last verified {show(verified)}")
    if throughput:  # trainer/evaluate.py's Throughput.report
        line += f" examples/s {throughput['examples_per_sec']:.1f}"
        if "tokens_per_sec" in throughput:
            line += f" tokens/s {throughput['tokens_per_sec']:.0f}"
        line += f" input_wait {1000 * throughput['input_wait_secs']:.2f}ms"
    return line


def eval_line(step: int, values: dict[str, float]) -> str:
    return f"eval step {step} " + " ".join(f"{name} {value:.6f}" for name, value in values.items())


class RunMetrics:
    """Process 0's view of the run at the log cadence: the progress line and the TensorBoard scalars."""

    def __init__(self, workdir: str, resumed_from: int | None = None):
        self.events = EventWriter(workdir, resumed_from)  # resumed_from: see trainer/event_files.py
        self.status = RunStatus(workdir)
        self._step_secs = 0.0  # wall time spent in steps (saves excluded) since this process started
        self._started = False

    def record_losses(self, losses: dict[int, float], scalars: dict[int, dict[str, float]]) -> None:
        """Each step's loss (with its grad_norm, param_norm, learning_rate) as metrics.jsonl gets it, written
        out at once: the loss log calls this wherever it appends the file, a preemption's flush included."""
        for step, loss in losses.items():
            self.events.scalars(step, {"loss": loss, **scalars.get(step, {})})
        self.events.flush()

    def report(self, *, total: int, losses: dict[int, float], steps_per_sec: float,
               step_secs: float, save_blocking_secs: list[float], commit_secs: list[float] = (),
               throughput: dict | None = None, scalars: dict[int, dict[str, float]] | None = None) -> None:
        """One interval's line and scalars, all at the step of its newest loss (the progress line's
        step, TensorBoard's step, metrics.jsonl's and the manifest's key for that loss are one number).
        The losses themselves reached TensorBoard with metrics.jsonl (record_losses)."""
        step = max(losses)
        if not self._started:
            self._started = True
            self.status.count_preemptions()
            self.events.scalars(step, {"restart/startup_to_first_log_secs": process_uptime_secs(),
                                       "preemptions": self.status.preemptions,
                                       **{f"restart/{n}_secs": v for n, v in _PHASES_SEEN.items()}})
        self._step_secs += step_secs
        self.status.refresh()
        committed, verified = self.status.committed, self.status.verified
        newest = (scalars or {}).get(step, {})  # the step's grad_norm, param_norm, learning_rate
        logging.info("%s%s", progress_line(step, total, losses[step], steps_per_sec, committed, verified,
                                           throughput),
                     "".join(f" {name} {value:.4g}" for name, value in sorted(newest.items())))
        values = {"steps_per_sec": steps_per_sec, "goodput_so_far": self._step_secs / max(process_uptime_secs(), 1e-9)}
        if save_blocking_secs:
            values["save/blocking_secs"] = max(save_blocking_secs)
        if commit_secs:  # the newest save's hand-off to commit, as the Saver measured it
            values["save/commit_secs"] = commit_secs[-1]
        for name, value in (throughput or {}).items():
            values[f"input/{name}" if name.startswith("input_") else f"throughput/{name}"] = value
        if committed is not None:
            values["checkpoint/last_committed_step"] = committed
            values["verifier/lag_steps"] = committed - (verified or 0)
        self.events.scalars(step, values)
        self.events.flush()

    def report_eval(self, step: int, values: dict[str, float]) -> None:
        """The eval numbers of `step` (trainer/evaluate.py): one log line and eval/<name> scalars."""
        logging.info("%s", eval_line(step, values))
        self.events.scalars(step, {f"{EVAL_PREFIX}{name.removeprefix('eval_')}": value
                                   for name, value in values.items()})
        self.events.flush()

    def close(self) -> None:
        self.events.close()
