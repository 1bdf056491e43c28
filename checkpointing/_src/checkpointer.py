"""`Checkpointer`: the one public entry to the checkpoint service, for our trainer and a user's loop alike.

    with Checkpointer(workdir, options, config=config, fixed=FIXED, mesh=mesh, total_steps=N) as ckpt:
        start = ckpt.restore_or_init(abstract_state, init_fn)       # precedence: options.resume_from
        state = start.state
        for step in range(start.step, N):
            state, loss = train_step(state, batch(step))
            ckpt.on_step(step + 1, state, loss)                       # -> SaveEvent; Preempted (exit 75)

Opening checks the request against the workdir (read only: a refused run changes nothing), then
takes the workdir's lease for the whole pod, opens the persistent tier and, with a local_dir, this
host's local tier. `on_step` dispatches the save marks (checkpointing/_src/marking.py), takes the preemption
decision once per step, asks the save schedule (steps, seconds, `auto`, the local tier, the preemption
deadline) and saves (`prepare` makes the marks ahead). `close` waits for the last commit and releases
the lease; leaving the block by an exception aborts instead (waits for the save in flight, so it cannot
race the next writer, and releases the lease). docs/api.md has every name.
"""

import dataclasses
from typing import Callable, Iterable

import jax
from absl import logging

from checkpointing._src import input_state, marking, probes, run_record, verdicts
from checkpointing._src import lease as lease_lib, restore as restore_lib, workdir as workdir_lib
from checkpointing.config import AUTO, CheckpointConfig, resolve_path
from checkpointing.errors import CheckpointError, LeaseLostError, WorkdirLeasedError
from checkpointing._src.probe_recorder import ProbeRecorder
from checkpointing._src.saver import SaveEvent, Saver
from checkpointing._src.schedule import SaveSchedule
from checkpointing._src.service import CheckpointService, RunMetadata
from runtime import collective
from runtime.dispatch import blocks_each_step
from runtime.preemption import PreemptionWatch
from runtime.watchdog import Watchdog


class Checkpointer:
    """Saves, restores and protects one run's state tree (see the module docstring).

    Args:
      workdir: the run's directory, a local path, gs:// or s3://.
      options: the checkpoint config (cadence, retention, resume precedence, tiers, lease).
      config: the run's whole config as JSON; every manifest records it.
      fixed: names of `config` fields a resume must not change (they shape the state or its numbers).
      mesh: the jax.sharding.Mesh the state lives on (recorded; a restore takes the abstract target's shardings).
      total_steps: the run's last step; a save there is "final", and no preemption save is made there.
      program: "package.module:factory" building the run's replay program for the verifier (docs/api.md); None: none.
      watchdog: bounds every wait (a dead peer, a stuck commit); by default one of `watchdog_secs`.
      data_iterator: a Grain iterator whose position is not a function of the step (a filter, packing):
        every persistent save holds its state, one file per process, and a restore sets it back
        (checkpointing/_src/input_state.py). None (the default): the step is the input's position.
    """

    def __init__(self, workdir: str, options: CheckpointConfig, *, config: dict, fixed: Iterable[str], mesh,
                 total_steps: int, program: str | None = None, watchdog: Watchdog | None = None,
                 watchdog_secs: float = 600.0, data_iterator=None):
        self.options = options.validated()
        if data_iterator is not None:
            input_state.check_iterator(data_iterator)
            if self.options.local_dir:  # a local step would hold no input position to resume from
                raise ValueError(f"--local_dir={self.options.local_dir}: a data_iterator is saved on the "
                                 "persistent tier only; use one or the other")
        self._data_iterator = data_iterator
        path = resolve_path(str(workdir), "workdir")  # one Workdir per open: each manifest read once
        self.workdir = workdir if isinstance(workdir, workdir_lib.Workdir) and workdir == path else \
            workdir_lib.Workdir(path)
        self.total_steps = total_steps
        self.mesh = mesh
        self._one_step_at_a_time = blocks_each_step(mesh)  # CPU meshes (runtime/dispatch.py): on_step waits
        run = RunMetadata.of_run(config, fixed, dict(mesh.shape), program=program, total_steps=total_steps)
        self._candidates = restore_lib.resume_candidates(self.workdir, self.options, run,  # refusals change nothing
                                                         total_steps=total_steps)
        if self._candidates:  # another process count, or an iterator saved but not passed: refused here
            input_state.check_restorable(self.workdir, self._candidates[0], process_count=_process_count(),
                                         has_iterator=data_iterator is not None)
        self.run = dataclasses.replace(run, init_from=restore_lib.init_from(self.workdir, self.options.init_from))
        run_record.check(self.workdir, self.run, starting_over=self._starting_over)  # the run's record: run.json
        self._lease = _acquire_pod_lease(self.workdir, self.options.lease_secs)
        if program is None and _process_index() == 0:  # said once, at open: the verifier would say it at the end
            logging.warning("Checkpointer without program=: every manifest records that this run cannot be "
                            "replayed; its checkpoints restore, but the verifier cannot prove them (docs/api.md)")
        self._owns_watchdog = watchdog is None
        self.watchdog = watchdog or Watchdog(watchdog_secs)
        self.preemption = PreemptionWatch()
        self._saver: Saver | None = None
        self._prepared: marking.Prepared | None = None
        self._closed = False
        self.local: CheckpointService | None = None
        try:
            check = _lease_check(self._lease)  # the lease covers both tiers
            self.service = CheckpointService(self.workdir, self.options, run=self.run, protected_steps=self._protected,
                                             preemption_decision=self.preemption.decided, writer_check=check,
                                             data_iterator=data_iterator)
            self.preemption.reports_committed(self.service.latest_committed_step)  # a second Ctrl-C's line
            if self.options.local_dir:
                directory = workdir_lib.expand_local_dir(self.options.local_dir, _process_index())
                local = dataclasses.replace(self.options, max_to_keep=self.options.local_max_to_keep,
                                            keep_every_steps=0)
                self.local = CheckpointService(directory, local, run=self.run, tier="local",
                                               preemption_decision=self.preemption.decided, writer_check=check)
        except BaseException:
            self._release()
            raise

    @property
    def _starting_over(self) -> bool:
        """--resume_from=none --rollback: every committed step set aside, and the run's record with them."""
        return self.options.resume_from == "none" and self.options.rollback

    @property
    def resume_candidates(self) -> list[int]:
        """The committed steps a restore will try, newest first ([]: a fresh start)."""
        return list(self._candidates)

    # --- restoring -----------------------------------------------------------------------------

    def prepare(self, abstract_state) -> marking.Prepared:
        """Optional, on every process: makes the fingerprints of states like `abstract_state` ahead, so the
        restore's check and a preemption's save compile nothing. Returns at once, loading the executable an
        earlier launch kept on a thread (beside the caller's compiles); `.result()` waits for it, or compiles
        it on the calling thread, and returns "disk" or "compiled". restore_or_init waits for it. Where the probes
        take their summaries on the devices, their compile starts here too, on a thread of its own."""
        self._prepared = marking.Prepared(abstract_state)
        if self._device_summaries(abstract_state):  # beside the caller's compiles, not after its restore
            marking.summaries_ahead(abstract_state)
        return self._prepared

    def restore_or_init(self, abstract_state, init_fn: Callable[[], object]) -> restore_lib.RestoreResult:
        """The state to start from, per options.resume_from (checkpointing/_src/restore.py): restored onto the
        shardings of `abstract_state` (ShapeDtypeStructs, e.g. jax.eval_shape of the init with the current
        mesh's shardings), checked leaf by leaf against the fingerprints taken at save time; else init_fn().
        With a data_iterator, a restored step also sets it to the position this process saved there."""
        with self.watchdog.bounded("restoring", self.watchdog.timeout_secs):
            if self._prepared is not None:
                self._prepared.result()
            start = restore_lib.restore_or_init(self.options, self.service, self.local, self._candidates,
                                                abstract_state, init_fn, self.run.init_from)
            if start.tier is None and collective.is_primary():  # a first start (or a start over): before any save
                run_record.record_first_start(self.workdir, self.run, starting_over=self._starting_over)
            if self._data_iterator is not None and start.tier is not None:
                input_state.check_restorable(self.workdir, start.step, process_count=_process_count(),
                                             has_iterator=True)  # a fallback past a corrupt step may differ
                self.service.restore_input(start.step)
        carried = {}
        if start.tier == "local":  # every process read its own copy: the same losses everywhere
            carried = {int(s): v for s, v in start.manifest["losses"].items()}
        self._saver = Saver(self.service, SaveSchedule(self.options, resumed_step=start.step,
                                                       resumed_manifest=start.manifest, resumed_tier=start.tier),
                            start_step=start.step, end_step=self.total_steps, preemption=self.preemption,
                            watchdog=self.watchdog, local=self.local, carried_losses=carried,
                            probes=self._probe_recorder(start, abstract_state))
        return start

    def _probe_recorder(self, start: restore_lib.RestoreResult, abstract_state) -> ProbeRecorder | None:
        if not self.options.probe_steps or self.run.program is None:
            return None  # a run the verifier does not replay needs no probes
        on_host = not self._device_summaries(abstract_state)
        if not on_host:  # on_step dispatches them at a window's end: compiled on a thread (from prepare, if called)
            marking.summaries_ahead(abstract_state)
        recorder = ProbeRecorder(self.workdir, self.options.probe_steps, self.total_steps, self.run.mesh, on_host)
        if start.tier == "persistent":
            recorder.saved(start.step, committed=True)  # if the attempt that saved it died first, this one records it
        return recorder

    def _device_summaries(self, abstract_state) -> bool:
        """Whether this run's probes take their summaries on the devices (compiled on a thread): probes are
        recorded (a program the verifier replays) and the state is not held whole on process 0's host. Started
        at prepare, the compile runs beside the step's: on a TPU v5e, started at the restore, the first probe
        waited 3.7 s for what was left of it (docs/performance.md)."""
        return bool(self.options.probe_steps and self.run.program is not None) and not (
            self.options.probe_summaries == AUTO and probes.host_held(abstract_state))

    # --- saving --------------------------------------------------------------------------------

    def on_step(self, step: int, state, loss=None, metrics: dict | None = None) -> SaveEvent:
        """Call after every step, on every process: `step` is the state's step counter (steps done) and
        `loss` the loss of step `step - 1` (a device scalar is fine: it is read only when a save records
        it). `metrics` ({name: number}, e.g. an eval loss measured at `step`) are recorded in the next
        save's manifest (extra.metrics["<step>"]). Saves when the schedule says; on a preemption saves,
        waits for the commit and raises Preempted (a SystemExit with code 75). Raises AsyncSaveError if
        the previous background save failed (the step it wrote is not committed; the one before stays
        the latest). First of all it dispatches the marks of `state` that a save of `step` certain now, or a
        probe's summaries due there, will read, so the save dispatches no pass of its own."""
        if self._saver is None:
            raise RuntimeError("Checkpointer.on_step before restore_or_init")
        self.workdir.live()  # the start-up is over: listings and manifests are read afresh from now on
        if self._one_step_at_a_time:  # the loop dispatches its next step only once this one is done
            jax.block_until_ready(loss if loss is not None else state)
        return self._saver.on_step(step, state, loss, metrics)

    # --- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the last save to commit (AsyncSaveError if it failed) and releases the lease."""
        if self._closed:
            return
        try:
            with self.watchdog.bounded("committing the final checkpoint", self.watchdog.timeout_secs):
                if self._saver is not None:
                    self._saver.close()
                else:
                    self.service.close()
        except BaseException:
            self.abort()
            raise
        self._release()

    def abort(self) -> None:
        """After a failure: waits (bounded) for a save still writing, so it cannot race the next writer,
        then releases the lease. Never raises over the error being handled."""
        if self._closed:
            return
        failed = False
        for tier in (self.service, self.local):
            if tier is None:
                continue
            with self.watchdog.bounded("ending the in-flight save", self.watchdog.timeout_secs):
                try:
                    tier.wait_until_finished()
                except CheckpointError:
                    failed = True  # the error being raised already says what failed
        self._remove_failed_saves(failed or self.service.failed_save)
        self._release()

    def _remove_failed_saves(self, failed: bool) -> None:
        """A failed save's temporary directory (a full disk) goes while this writer still holds the lease, so
        its relaunch finds the space it needs; never after the lease was lost (the new holder's saves)."""
        if not failed or self._lease is None:
            return
        try:
            self._lease.check()
            removed = workdir_lib.remove_killed_saves(self.workdir)
        except Exception as err:  # noqa: BLE001  the next holder removes them; the failure is being raised
            logging.warning("could not remove the failed save's temporary directory (%s)", err)
            return
        if removed:
            logging.info("removed the temporary directory of the failed save: %s", removed)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _release(self) -> None:
        self._closed = True
        self.preemption.close()
        if self._owns_watchdog:
            self.watchdog.stop()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _protected(self, steps: list[int]) -> list[int]:
        """Retention never deletes the newest of `steps` (Orbax's) that the verifier reproduced: the next
        proof starts there."""
        newest = verdicts.newest_proved_step(self.workdir, steps)
        return [] if newest is None else [newest]


def _process_index() -> int:
    import jax

    return jax.process_index()


def _process_count() -> int:
    import jax

    return jax.process_count()


def _acquire_pod_lease(workdir: str, lease_secs: float) -> lease_lib.Lease | None:
    """Process 0 takes the workdir's lease for the whole pod; every process raises if it cannot."""
    lease, error = None, None
    if collective.is_primary():
        try:
            if lease_lib.free_to_take(workdir):  # a save that filled the disk must not keep the lease from us
                removed = workdir_lib.remove_killed_saves(workdir)
                if removed:
                    logging.info("removed the temporary directories of saves that never committed: %s", removed)
            lease = lease_lib.acquire(workdir, lease_secs)
        except Exception as err:  # the other processes must not wait in the broadcast forever
            error = err
    outcome = collective.broadcast_int(0 if error is None else 2 if isinstance(error, WorkdirLeasedError) else 1)
    if outcome and error is None:
        error = (WorkdirLeasedError if outcome == 2 else CheckpointError)(
            f"process 0 could not take the lease on {workdir} (its log names the holder)")
    if error is not None:
        raise error
    return lease


def _lease_check(lease: lease_lib.Lease | None):
    """The service's check before each save: every process stops once process 0's lease is lost."""

    def check(step: int) -> None:
        lost = None
        if lease is not None:
            try:
                lease.check()
            except LeaseLostError as err:
                lost = str(err)
        if collective.decided_by_primary(lambda: lost is not None):
            lost = lost or "process 0 lost the workdir lease (its log names the new holder)"
        if lost is not None:
            raise LeaseLostError(f"step {step} not saved: {lost}")

    return check
