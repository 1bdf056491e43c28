"""Metrics people can look at: TensorBoard event files and one progress line per log cadence.

Process 0 writes `<workdir>/tensorboard/` (never under `checkpoints/`, which Orbax owns) with
tensorboardX (no TensorFlow). On a gs:// workdir the events go to a local staging file that is
uploaded whole through the same storage layer as the checkpoints (at most every
UPLOAD_EVERY_SECS, and at close). Metrics are a convenience: a failing write warns once and
training goes on; the checkpoints' manifests record every loss.

Start-up phases are logged by process 0 as `phase <name> <seconds>s` (names in PHASES);
`parse_phases` reads them back from a log (the goodput benchmark does).
"""

import os
import re
import shutil
import tempfile
import threading
import time

import psutil
from absl import logging
from etils import epath

from checkpointing import committed_steps, newest_proved_step, one_line_cause, read_manifest, tensorboard_dir

PHASES = ("process_start", "distributed_start", "open", "compile", "restore", "first_step")
PHASE_LINE = re.compile(r"\bphase (\w+) ([0-9.]+)s\b")
UPLOAD_EVERY_SECS = 60.0
# The committed/verified steps are re-read at most this often (on gs:// each read is a request).
STATUS_EVERY_SECS = {"local": 10.0, "gs": 60.0}


_PHASES_SEEN: dict[str, float] = {}  # this process's start-up phases, written with the first scalars


def record_phase(name: str, secs: float) -> None:
    """Keeps a start-up phase's duration for TensorBoard (`restart/<name>_secs`); the caller logs the line."""
    _PHASES_SEEN[name] = secs


def parse_phases(text: str) -> dict[str, float]:
    """{phase: seconds} from a log's `phase <name> <seconds>s` lines (the last of each name wins)."""
    return {name: float(secs) for name, secs in PHASE_LINE.findall(text) if name in PHASES}


def process_uptime_secs() -> float:
    return time.time() - psutil.Process().create_time()


class EventWriter:
    """Scalars into TensorBoard event files; the first failure warns once and turns writing off."""

    def __init__(self, workdir: str):
        self._target = tensorboard_dir(workdir)
        self._remote = workdir.startswith("gs://")
        self._writer = None
        self._broken = False
        self._uploaded_at = 0.0
        self._threads: set = set()  # its tensorboardX writer threads, claimed by owns_failed_thread

    @property
    def enabled(self) -> bool:
        return not self._broken

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._broken:
            return
        try:
            writer = self._open()
            for tag, value in values.items():
                writer.add_scalar(tag, float(value), step)
        except Exception as err:  # a metrics write never stops training
            self._fail("write", err)

    def flush(self, force: bool = False) -> None:
        if self._broken or self._writer is None:
            return
        try:
            self._writer.flush()
            if self._remote and (force or time.monotonic() - self._uploaded_at >= UPLOAD_EVERY_SECS):
                self._upload(self._writer.logdir)
        except Exception as err:
            self._fail("flush", err)

    def close(self) -> None:
        """Drains the writer's queue (its flush does not) and, on gs://, uploads the whole file."""
        writer = self._writer
        if self._broken or writer is None:
            self._forget()
            return
        try:
            writer.close()  # its thread drains the queue: a failure there is owns_failed_thread's
            if self._remote:
                self._upload(writer.logdir)
                shutil.rmtree(writer.logdir, ignore_errors=True)  # the staging copy
        except Exception as err:
            self._fail("close", err)
        finally:
            self._forget()

    def _forget(self) -> None:
        self._writer = None
        # A given-up writer's threads may still be draining its queue onto a full disk after close:
        # it stays listed, so their failure is still its warning, not a traceback.
        if self in _OPEN_WRITERS and not self._broken:
            _OPEN_WRITERS.remove(self)

    def _open(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter  # imported late: only process 0 pays for it

            logdir = tempfile.mkdtemp(prefix="tensorboard-") if self._remote else self._target
            self._writer = SummaryWriter(logdir=logdir, flush_secs=3600)  # flushed at the log cadence
            _OPEN_WRITERS.append(self)
        return self._writer

    def owns_failed_thread(self, args) -> bool:
        """If `args` (threading.excepthook's) is one of this writer's tensorboardX threads failing (a full
        disk while it writes queued events), the warning and turning writing off, instead of a traceback."""
        self._threads |= {file_writer.event_writer._worker
                          for file_writer in (getattr(self._writer, "all_writers", None) or {}).values()}
        if args.thread not in self._threads or not isinstance(args.exc_value, OSError):
            return False
        if not self._broken:
            self._fail("write", args.exc_value)
        return True

    def _upload(self, local_dir: str) -> None:
        for name in os.listdir(local_dir):  # one events file per writer; copied whole, replacing the last copy
            with open(os.path.join(local_dir, name), "rb") as f:
                (epath.Path(self._target) / name).write_bytes(f.read())
        self._uploaded_at = time.monotonic()

    def _fail(self, what: str, err: Exception) -> None:
        self._broken = True
        # tensorboardX flushes again at exit and prints a traceback over the run's last line when
        # the disk is still full: its writers are given up here (events are a convenience copy).
        for file_writer in (getattr(self._writer, "all_writers", None) or {}).values():
            file_writer.event_writer._closed = True
            self._threads.add(file_writer.event_writer._worker)
        logging.warning("metrics: cannot %s TensorBoard events under %s (%s); training goes on without them",
                        what, self._target, one_line_cause(err))


_OPEN_WRITERS: list[EventWriter] = []
_previous_excepthook = threading.excepthook


def _excepthook(args) -> None:
    if not any(writer.owns_failed_thread(args) for writer in list(_OPEN_WRITERS)):
        _previous_excepthook(args)


threading.excepthook = _excepthook  # tensorboardX writes from a thread of its own


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
        every = STATUS_EVERY_SECS["gs" if self._workdir.startswith("gs://") else "local"]
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

    def __init__(self, workdir: str):
        self.events = EventWriter(workdir)
        self.status = RunStatus(workdir)
        self._step_secs = 0.0  # wall time spent in steps (saves excluded) since this process started
        self._started = False

    def report(self, *, total: int, losses: dict[int, float], steps_per_sec: float,
               step_secs: float, save_blocking_secs: list[float], commit_secs: list[float] = (),
               throughput: dict | None = None, scalars: dict[int, dict[str, float]] | None = None) -> None:
        """One interval's line and scalars, all at the step of its newest loss (the progress line's
        step, TensorBoard's step, metrics.jsonl's and the manifest's key for that loss are one number)."""
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
        for s, loss in losses.items():
            self.events.scalars(s, {"loss": loss, **(scalars or {}).get(s, {})})
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
        self.events.scalars(step, {f"eval/{name.removeprefix('eval_')}": value for name, value in values.items()})
        self.events.flush()

    def close(self) -> None:
        self.events.close()
