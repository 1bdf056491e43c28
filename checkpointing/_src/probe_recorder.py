"""The trainer's side of the cheap proof: records each persistent save's probe (checkpointing/_src/probes.py).

A window opens when a persistent save of S starts (or the run resumes from a persistent S), collects
the losses of steps S .. S+k-1 as device scalars as they come, and at step S+k takes the state's
per-leaf summaries: where process 0 holds the state whole in host memory (`on_host`, probes.host_held),
process 0 sums it there before the next step can donate it (probes.host_summaries, ~13 ms for the goodput
benchmark's 45 MiB); else they are dispatched on the devices, with that step's marks (on_step dispatches
them, checkpointing/_src/marking.py; a state not on NamedShardings of one mesh: one jit of their own), on every
process: it is a collective on the mesh. A window is written by process 0 at a later step boundary, once S
has committed and its values are on the host (`is_ready`), or at close. k is `probe_steps`, shortened by the
run's end; 0 records none.
The file itself (a read of the manifest, a durable write: two fsyncs) is written on a thread of its own,
so the step loop never waits for the disk; close waits for it.
"""

import concurrent.futures
import dataclasses

import jax
from absl import logging

from checkpointing._src import marks as marks_lib
from checkpointing._src import probes
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CheckpointError, one_line_cause


@dataclasses.dataclass
class _Window:
    step: int  # the saved step
    end: int  # the summary's step: S + k
    losses: dict = dataclasses.field(default_factory=dict)  # step -> device scalar (or float)
    summaries: object = None  # on device once dispatched: a (sum, norm) tree, or the step's marks; or host_summaries'
    summary_pass: str | None = None  # how they were taken (probes.STEP_PASS, SEPARATE_PASS, HOST_PASS)
    summary_paths: list | None = None  # the state's leaf paths when `summaries` are the step's marks
    committed: bool = False


class ProbeRecorder:
    def __init__(self, workdir: str, probe_steps: int, end_step: int, mesh_shape: dict, on_host: bool = False):
        self._workdir = workdir
        self._steps = probe_steps
        self._end_step = end_step
        self._mesh = dict(mesh_shape)
        self._on_host = on_host  # probes.host_held of the run's state: the same on every process
        self._windows: list[_Window] = []
        self._failed = False  # one warning per run for a probe that cannot be written
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None  # started at the first probe
        self._writes: list[concurrent.futures.Future] = []

    def saved(self, step: int, committed: bool = False) -> None:
        """A persistent save of `step` started (committed=True: the run resumed from it)."""
        end = min(step + self._steps, self._end_step)
        if self._steps > 0 and end > step:
            self._windows = [w for w in self._windows if w.step != step] + [_Window(step, end, committed=committed)]

    def committed(self, step: int) -> None:
        for window in self._windows:
            if window.step == step:
                window.committed = True

    def add_loss(self, step: int, loss) -> None:
        for window in self._windows:
            if window.step <= step < window.end and loss is not None:
                window.losses[step] = loss

    def summaries_due(self, step: int) -> bool:
        """Whether the step that makes the state of `step` should compute its summaries on the devices (a
        window ends there, and they are not taken on the host): the same on every process."""
        return not self._on_host and any(window.end == step and window.summaries is None
                                         for window in self._windows)

    def on_step(self, step: int, state, summaries=None) -> None:
        """At a window's end takes its summaries: on the host (process 0), or the step's marks' `summaries`
        (checkpointing/_src/marking.py), or else dispatches them; then writes the windows that are ready."""
        for window in self._windows:
            if window.end == step and window.summaries is None:
                if self._on_host:  # only process 0 writes probes: the others have nothing to compute
                    summaries = probes.host_summaries(state) if jax.process_index() == 0 else {}
                    window.summaries, window.summary_pass = summaries, probes.HOST_PASS
                elif summaries is not None:
                    window.summaries, window.summary_paths = summaries, marks_lib.leaf_paths(state)
                    window.summary_pass = probes.STEP_PASS
                else:
                    window.summaries, window.summary_pass = probes.leaf_summaries(state), probes.SEPARATE_PASS
        self._write(ready_only=True)

    def close(self) -> None:
        """Writes every complete window (waiting for its values); drops the ones the run never reached."""
        self._write(ready_only=False)
        self._windows = []
        for write in self._writes:
            write.result()  # _store never raises: it warns
        self._writes = []
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _write(self, ready_only: bool) -> None:
        keep = []
        for window in self._windows:
            if window.summaries is None or not window.committed or (ready_only and not _ready(window)):
                keep.append(window)
                continue
            if jax.process_index() == 0:
                self._write_one(window)
        self._windows = keep

    def _write_one(self, window: _Window) -> None:
        if len(window.losses) != window.end - window.step:
            missing = sorted(set(range(window.step, window.end)) - set(window.losses))
            self._warn(window.step, CheckpointError(f"losses of steps {missing} were not given to on_step"))
            return
        values = jax.device_get(dict(window.losses))  # ready (is_ready), or at close: no wait in the loop
        losses = {s: float(v) for s, v in values.items()}
        how = window.summary_pass
        if how == probes.HOST_PASS:
            summaries = window.summaries
        elif how == probes.STEP_PASS:
            summaries = marks_lib.summaries_of(window.summaries, window.summary_paths)
        else:
            summaries = probes.to_host(window.summaries)
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probe-writer")
        self._writes = [w for w in self._writes if not w.done()]
        self._writes.append(self._writer.submit(self._store, window.step, window.end, losses, summaries, how))

    def _store(self, step: int, end: int, losses: dict, summaries: dict, how: str) -> None:
        """On the writer thread: the probe file of `step`, unless one for the same save exists."""
        try:
            existing = probes.read(self._workdir, step)
            digest = workdir_lib.read_manifest(self._workdir, step)["digest"]
            if existing is not None and existing["manifest_digest"] == digest:
                return  # the attempt that saved it continued from its own state: the better witness
            probes.write(self._workdir, probes.make(
                step=step, manifest_digest=digest, losses=losses, summary_step=end, summaries=summaries,
                mesh=self._mesh, process_count=jax.process_count(), summary_pass=how))
        except (CheckpointError, OSError) as err:  # a reader's file: never the run's failure
            self._warn(step, err)

    def _warn(self, step: int, err: Exception) -> None:
        if not self._failed:
            logging.warning("probe of step %d not recorded (%s); the verifier's cheap proof of it waits for none",
                            step, one_line_cause(err))
        self._failed = True


def _ready(window: _Window) -> bool:
    on_device = [] if window.summary_pass == probes.HOST_PASS else jax.tree.leaves(window.summaries)
    return all(leaf.is_ready() for leaf in on_device) and all(
        not hasattr(loss, "is_ready") or loss.is_ready() for loss in window.losses.values())
