"""The training loop: build the program, run the donated step, pull losses at the log cadence."""

import dataclasses
import json
import os
import time

import jax
from absl import logging

from checkpointing.policy import SavePolicy
from launch.preemption import PreemptionWatch
from launch.watchdog import Watchdog
from trainer import checkpoints
from trainer.config import TrainConfig, format_mesh
from trainer.program import Program, build_mesh, build_program

METRICS_FILE = "metrics.jsonl"


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
        self._metrics_path = os.path.join(workdir, METRICS_FILE) if jax.process_index() == 0 else None

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
            with open(self._metrics_path, "a") as f:
                f.write("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in fresh.items()))
        return fresh


def read_metrics(workdir: str) -> dict[int, float]:
    """The metrics file as {step: loss}; a step logged twice (after a resume) keeps its last value."""
    losses = {}
    with open(os.path.join(workdir, METRICS_FILE)) as f:
        for line in f:
            record = json.loads(line)
            losses[record["step"]] = record["loss"]
    return losses


def run_steps(program: Program, state, start_step: int, end_step: int, loss_log: LossLog,
              on_step=None):
    """Runs steps [start_step, end_step); `on_step(step, state)` runs after each (for saves)."""
    config = program.config
    sync_each_step = blocks_each_step(program)
    tick, tick_step = time.perf_counter(), start_step
    for step in range(start_step, end_step):
        state, loss = program.step_fn(state, program.batch_fn(step))
        loss_log.add(step, loss)
        if sync_each_step:
            loss.block_until_ready()
        done = step + 1
        if done % config.log_every_steps == 0 or done == end_step:
            fresh = loss_log.flush()
            now = time.perf_counter()
            if jax.process_index() == 0:
                logging.info("step %d loss %.6f steps/s %.2f", done, fresh[step],
                             (done - tick_step) / max(now - tick, 1e-9))
            tick, tick_step = now, done
        if on_step is not None:
            state = on_step(done, state, loss_log)
    return state


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


def train(config: TrainConfig) -> TrainResult:
    """Trains up to `config.steps`, resuming per --resume_from and saving per the config."""
    candidates = checkpoints.resume_candidates(config)
    mesh = build_mesh(config)
    program = build_program(config, mesh)
    if jax.process_index() == 0:
        logging.info("model %s on mesh %s (%d processes), %d steps", config.model,
                     format_mesh(config.mesh), jax.process_count(), config.steps)
    preemption = PreemptionWatch()
    watchdog = Watchdog(config.watchdog_secs)
    try:
        service = checkpoints.open_service(config, program, preemption_decision=preemption.decided)
        with watchdog.bounded("restoring", config.watchdog_secs):
            start_step, state = checkpoints.restore_or_init(program, service, candidates)
        saver = checkpoints.Saver(service, SavePolicy(config.save_every_steps, config.save_every_secs),
                                  start_step=start_step, end_step=config.steps, preemption=preemption,
                                  watchdog=watchdog, grace_secs=config.preemption_grace_secs)
        loss_log = LossLog(config.workdir)
        start = time.perf_counter()
        watchdog.pet(f"step {start_step + 1} (compiles the step)")
        state = run_steps(program, state, start_step, config.steps, loss_log, on_step=saver)
        with watchdog.bounded("committing the final checkpoint", config.watchdog_secs):
            jax.block_until_ready(state)
            service.close()  # waits for the last save to commit (or raises AsyncSaveError)
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
