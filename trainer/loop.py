"""The training loop: build the program, run the donated step, pull losses at the log cadence."""

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from checkpointing import lease as lease_lib
from checkpointing import workdir as workdir_lib
from checkpointing.errors import CheckpointError, LeaseLostError, WorkdirLeasedError, one_line_cause
from checkpointing.config import format_mesh
from runtime.preemption import PreemptionWatch
from runtime.watchdog import Watchdog
from trainer import checkpoints, compile_cache, metrics
from trainer import saver as saver_lib
from trainer.config import TrainConfig
from trainer.metrics import RunMetrics
from trainer.program import Program, build_mesh, build_program



@dataclasses.dataclass
class TrainResult:
    losses: dict[int, float]  # loss of each step this process ran, keyed by the step that computed it
    state: object  # the final TrainState (on the mesh)
    steps_per_sec: float


def blocks_each_step(program: Program) -> bool:
    """Whether the loop must wait for each step before dispatching the next.

    XLA's CPU runtime runs every (fake) device of a process on a pool with one thread per
    device, and its in-process collectives need all of a step's device tasks running at once.
    With a second step's tasks queued behind a blocked one the pool can deadlock (seen about
    once in a few hundred 8-device steps on 2 cores). On CPU the wait costs nothing measurable;
    on TPU and GPU the loop stays fully asynchronous.
    """
    return jax.default_backend() == "cpu" and program.mesh.size > 1


class LossLog:
    """Per-step losses kept on device until the log cadence, then pulled in one transfer."""

    def __init__(self, workdir: str):
        self._pending: list[tuple[int, jax.Array]] = []
        self.losses: dict[int, float] = {}
        self._metrics_path = workdir_lib.metrics_file(workdir) if jax.process_index() == 0 else None
        self.metrics = RunMetrics(workdir) if jax.process_index() == 0 else None  # TensorBoard + progress

    def add(self, step: int, loss: jax.Array) -> None:
        self._pending.append((step, loss))

    def flush(self) -> dict[int, float]:
        """Pulls pending losses to the host (one sync) and appends them to the metrics file."""
        if not self._pending:
            return {}
        values = jax.device_get([loss for _, loss in self._pending])
        fresh = {step: float(value) for (step, _), value in zip(self._pending, values)}
        self._pending.clear()
        self.losses.update(fresh)
        if self._metrics_path and not self._metrics_path.startswith("gs://"):
            data = "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in fresh.items()).encode()
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
                    logging.WARNING, "metrics: cannot append steps %d..%d to %s (%s); training goes on, "
                    "the checkpoints' manifests record every loss", 600, min(fresh), max(fresh),
                    self._metrics_path, one_line_cause(err))
        return fresh


def read_metrics(workdir: str) -> dict[int, float]:
    """The metrics file as {step: loss}; a step logged twice (after a resume) keeps its last value."""
    losses = {}
    with open(workdir_lib.metrics_file(workdir)) as f:
        for line in f:
            record = json.loads(line)
            losses[record["step"]] = record["loss"]
    return losses


def run_steps(program: Program, state, start_step: int, end_step: int, loss_log: LossLog,
              on_step=None):
    """Runs steps [start_step, end_step); `on_step(step, state)` runs after each (for saves).

    At the log cadence process 0 logs one progress line and writes its TensorBoard scalars; the
    time spent in `on_step` when it saved (its `last_saved_step` moved) is the save's blocking time.
    """
    config = program.config
    sync_each_step = blocks_each_step(program)
    tick, tick_step = time.perf_counter(), start_step
    hook_secs, save_blocking = 0.0, []
    try:
        for step in range(start_step, end_step):
            # The step number is the one value the host sends each step; any other transfer is an
            # error under jax.transfer_guard("disallow") (tests/test_loop_transfers.py runs it so).
            with jax.transfer_guard_host_to_device("allow"):
                batch = program.batch_fn(step)
            state, loss = program.step_fn(state, batch)
            loss_log.add(step, loss)
            if step == start_step:  # one sync, once: the restart's latency ends when its first loss is ready
                loss.block_until_ready()
                log_phase("first_step", time.perf_counter() - tick)
                hits, lookups = compile_cache.lookups()
                if lookups:  # every process: each has its own cache entries (trainer/compile_cache.py)
                    logging.info("compilation cache: %d of %d lookups hit (process %d)", hits, lookups,
                                 jax.process_index())
            if sync_each_step:
                loss.block_until_ready()
            done = step + 1
            if done % config.log_every_steps == 0 or done == end_step:
                fresh = loss_log.flush()
                now = time.perf_counter()
                if loss_log.metrics is not None:
                    loss_log.metrics.report(step=done, total=config.steps, losses=fresh,
                                            steps_per_sec=(done - tick_step) / max(now - tick, 1e-9),
                                            step_secs=max(now - tick - hook_secs, 0.0),
                                            save_blocking_secs=save_blocking,
                                            commit_secs=getattr(on_step, "commit_secs", []))
                tick, tick_step, hook_secs, save_blocking = now, done, 0.0, []
            if on_step is not None:
                saved_before, hook_start = getattr(on_step, "last_saved_step", None), time.perf_counter()
                state = on_step(done, state, loss_log)
                hook_secs += time.perf_counter() - hook_start
                if getattr(on_step, "last_saved_step", None) != saved_before:
                    save_blocking.append(time.perf_counter() - hook_start)
    finally:
        if loss_log.metrics is not None:
            loss_log.metrics.close()
    return state


def log_phase(name: str, secs: float) -> None:
    """One start-up phase's duration, as `phase <name> <secs>s` (benchmarks parse this line)."""
    if jax.process_index() == 0:
        logging.info("phase %s %.3fs", name, secs)
        metrics.record_phase(name, secs)


def compile_program(program: Program, *, fresh: bool) -> None:
    """Compiles the batch function, the step and (starting fresh) the init ahead of the loop.

    jit's own cache then holds these executables, so the loop's first calls compile nothing; with
    the persistent compilation cache on, a warm restart loads them from disk instead.
    """
    program.batch_fn.lower(0).compile()
    batch = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=program.batch_sharding),
                         jax.eval_shape(program.batch_fn, 0))
    program.step_fn.lower(program.abstract_state, batch).compile()
    if fresh:
        program.init_fn.lower().compile()


def replay_losses(program: Program, state, start_step: int, num_steps: int):
    """Runs `num_steps` steps from `state` (at `start_step`); returns (state, {step: loss})."""
    losses = []
    for step in range(start_step, start_step + num_steps):
        state, loss = program.step_fn(state, program.batch_fn(step))
        losses.append(loss)
        if blocks_each_step(program):
            loss.block_until_ready()
    values = jax.device_get(losses)
    return state, {start_step + i: float(v) for i, v in enumerate(values)}


def _acquire_pod_lease(config: TrainConfig) -> lease_lib.Lease | None:
    """Process 0 takes the workdir's lease for the whole pod; every process raises if it cannot."""
    lease, error = None, None
    if jax.process_index() == 0:
        try:
            lease = lease_lib.acquire(config.workdir, config.checkpoint.lease_secs)
        except Exception as err:  # the other processes must not wait in the broadcast forever
            error = err
    outcome = 0 if error is None else 2 if isinstance(error, WorkdirLeasedError) else 1
    if jax.process_count() > 1:
        outcome = int(multihost_utils.broadcast_one_to_all(np.int32(outcome)))
    if outcome and error is None:
        error = (WorkdirLeasedError if outcome == 2 else CheckpointError)(
            f"process 0 could not take the lease on {config.workdir} (its log names the holder)")
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
        if jax.process_count() > 1 and int(multihost_utils.broadcast_one_to_all(np.int32(lost is not None))):
            lost = lost or "process 0 lost the workdir lease (its log names the new holder)"
        if lost is not None:
            raise LeaseLostError(f"step {step} not saved: {lost}")

    return check


def train(config: TrainConfig, startup_phases: dict[str, float] | None = None) -> TrainResult:
    """Trains up to `config.steps`, resuming per --resume_from and saving per the config.

    `startup_phases` are the entry point's own phases (process start, distributed start-up), logged
    with the loop's (compile, restore, first step) as `phase <name> <secs>s` lines.

    The workdir's lease is taken after the read-only resume checks and before anything is written
    (a refused trainer leaves the workdir as it was), and released on every exit Python sees.
    """
    candidates = checkpoints.resume_candidates(config)
    lease = _acquire_pod_lease(config)
    # Logged once the run is admitted: a refused run prints its one error line and nothing else.
    for name, secs in (startup_phases or {}).items():
        log_phase(name, secs)
    try:
        return _train_holding_lease(config, candidates, lease)
    finally:
        if lease is not None:
            lease.release()


def _train_holding_lease(config: TrainConfig, candidates: list[int], lease: lease_lib.Lease | None) -> TrainResult:
    mesh = build_mesh(config)
    program = build_program(config, mesh)
    if jax.process_index() == 0:
        logging.info("model %s on mesh %s (%d processes), %d steps", config.model,
                     format_mesh(config.mesh), jax.process_count(), config.steps)
    begin = time.perf_counter()
    compile_program(program, fresh=not candidates)
    log_phase("compile", time.perf_counter() - begin)
    preemption = PreemptionWatch()
    watchdog = Watchdog(config.watchdog_secs)
    service = local = None
    try:
        writer_check = _lease_check(lease)  # the lease covers both tiers
        service = checkpoints.open_service(config, program, preemption_decision=preemption.decided,
                                           writer_check=writer_check)
        local = checkpoints.open_local_service(config, program, preemption_decision=preemption.decided,
                                               writer_check=writer_check)
        begin = time.perf_counter()
        with watchdog.bounded("restoring", config.watchdog_secs):
            start_step, state, tier = checkpoints.restore_or_init(program, service, candidates, local)
        jax.block_until_ready(state)
        log_phase("restore", time.perf_counter() - begin)
        saver = saver_lib.make_saver(config, service, local, start_step=start_step, resumed_tier=tier,
                                     preemption=preemption, watchdog=watchdog)
        loss_log = LossLog(config.workdir)
        start = time.perf_counter()
        watchdog.pet(f"step {start_step + 1} (compiles the step)")
        state = run_steps(program, state, start_step, config.steps, loss_log, on_step=saver)
        with watchdog.bounded("committing the final checkpoint", config.watchdog_secs):
            jax.block_until_ready(state)
            service.close()  # waits for the last save to commit (or raises AsyncSaveError)
            if local is not None:
                saver.close_local()
    except BaseException:
        # A save still writing once the lease is released could race the next writer.
        for tier_service in (service, local):
            if tier_service is None:
                continue
            with watchdog.bounded("ending the in-flight save", config.watchdog_secs):
                try:
                    tier_service.wait_until_finished()
                except CheckpointError:
                    pass  # the error being raised already says what failed
        raise
    finally:
        watchdog.stop()
        preemption.close()
    elapsed = time.perf_counter() - start
    ran = max(config.steps - start_step, 0)
    result = TrainResult(losses=loss_log.losses, state=state, steps_per_sec=ran / max(elapsed, 1e-9))
    if jax.process_index() == 0 and ran:
        logging.info("done: steps %d..%d, final loss %.6f, %.2f steps/s", start_step, config.steps,
                     result.losses[config.steps - 1], result.steps_per_sec)
    return result
