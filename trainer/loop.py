"""The training loop: build the program, run the donated step, pull losses at the log cadence."""

import contextlib
import dataclasses
import os
import time

import jax
from absl import logging

from checkpointing import Checkpointer, Preempted, Workdir
from checkpointing.config import format_mesh, is_object_store
from checkpointing.inspection import layout_of
from runtime.dispatch import blocks_each_step
from runtime.watchdog import Watchdog
from trainer import code as code_lib
from trainer import compile_cache, data, event_files, metrics, model_config, models
from trainer.evaluate import Evaluator, Throughput
from trainer.config import CODE_FIELD, TrainConfig
from trainer.loss_log import LossLog, read_metrics  # noqa: F401  (read_metrics: tests read runs through loop)
from trainer.program import REPLAY_PROGRAM, Program, build_mesh, build_program, computation, jax_precision


@dataclasses.dataclass
class TrainResult:
    losses: dict[int, float]  # loss of each step this process ran, keyed by the step that computed it
    state: object  # the final TrainState (on the mesh)
    steps_per_sec: float


def run_steps(program: Program, state, start_step: int, end_step: int, loss_log: LossLog, on_step=None,
              evaluator: Evaluator | None = None):
    """Runs steps [start_step, end_step); `on_step(steps_done, state, loss)` runs after each (a
    Checkpointer's on_step) and returns a SaveEvent, or None when it did nothing worth reporting.

    At the log cadence process 0 logs one progress line and writes its TensorBoard scalars, with the
    blocking time of the saves the events reported and the throughput. Every --eval_every_steps the
    evaluator's numbers are logged and handed to on_step as `metrics` (the next manifest records them).
    """
    config = program.config
    sync_each_step = blocks_each_step(program.mesh)
    tick, tick_step = time.perf_counter(), start_step
    throughput = Throughput(program)
    hook_secs, save_blocking, commit_secs = 0.0, [], []
    try:
        for step in range(start_step, end_step):
            # The step number is the one value the host sends each step; any other transfer is an
            # error under jax.transfer_guard("disallow") (tests/test_loop_transfers.py runs it so).
            with jax.transfer_guard_host_to_device("allow"):
                batch = program.batch_fn(step)
            throughput.add_wait()
            state, loss, scalars = program.step_fn.with_scalars(state, batch)
            loss_log.add(step, loss, scalars)
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
                    loss_log.metrics.report(total=config.steps, losses=fresh,
                                            steps_per_sec=(done - tick_step) / max(now - tick, 1e-9),
                                            step_secs=max(now - tick - hook_secs, 0.0),
                                            save_blocking_secs=save_blocking, commit_secs=commit_secs,
                                            throughput=throughput.report(done - tick_step, now - tick),
                                            scalars=loss_log.scalars)
                tick, tick_step, hook_secs, save_blocking = now, done, 0.0, []
            # The eval of step `done`: the state at counter `done`, whose params step done's update
            # starts from (the numbering of docs/training.md#step-numbering).
            evaluated = evaluator.maybe_evaluate(done, state.params) if evaluator is not None else None
            if evaluated and loss_log.metrics is not None:
                loss_log.metrics.report_eval(done, evaluated)
                loss_log.record_eval(done, evaluated)
            if on_step is not None:
                hook_start = time.perf_counter()
                extra = {"metrics": evaluated} if evaluated else {}
                event = on_step(done, state, loss, **extra)
                hook_secs += time.perf_counter() - hook_start
                if event is not None:
                    commit_secs = list(event.commit_secs)
                    if event.committed and loss_log.metrics is not None:
                        loss_log.metrics.status.saw_commit(max(event.committed))
                    if event.saved:
                        save_blocking.append(event.blocking_secs)
    except Preempted:
        loss_log.flush()  # the preemption checkpoint committed: its steps' losses reach metrics.jsonl too
        raise
    finally:
        if loss_log.metrics is not None:
            loss_log.metrics.close()
    return state


class OpenParts:
    """The `open` phase's parts (devices, validate, workdir, inputs, resume_check, checkpointer, program), each
    timed from the previous mark and logged by process 0 with the phase as one `open parts:` line: never a
    `phase` line, which benchmarks parse (trainer/metrics.py PHASES)."""

    def __init__(self, started: float | None = None):
        self._last = time.perf_counter() if started is None else started
        self.secs: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.secs[name] = self.secs.get(name, 0.0) + now - self._last
        self._last = now

    def log(self) -> None:
        if jax.process_index() == 0 and self.secs:
            logging.info("open parts: %s", ", ".join(f"{name} {secs:.3f}s" for name, secs in self.secs.items()))


def log_phase(name: str, secs: float) -> None:
    """One start-up phase's duration, as `phase <name> <secs>s` (benchmarks parse this line)."""
    if jax.process_index() == 0:
        logging.info("phase %s %.3fs", name, secs)
        metrics.record_phase(name, secs)


def compile_program(program: Program, *, fresh: bool, prepare=None) -> None:
    """Compiles the batch function, the step and (starting fresh) the init ahead, and with `prepare` (a
    Checkpointer's) the save marks' fingerprints.

    jit's own cache then holds these executables, so the loop's first calls compile nothing; with
    the persistent compilation cache on, a warm restart loads them from disk instead. Meanwhile TensorBoard's
    writer loads on a thread (trainer/event_files.py), so the first log line imports nothing.
    """
    event_files.preload()
    if hasattr(program.batch_fn, "lower"):  # synthetic: a jitted draw (records are read, not compiled)
        program.batch_fn.lower(0).compile()
    lowered = program.step_fn.lower(program.abstract_state, program.abstract_batch)  # the trace: the interpreter's
    # The fingerprints that the restore's check and every save dispatch: a kept executable loads on a thread
    # beside the step's compile (on a TPU v5e that load took 4 s of a restart, docs/performance.md); one not
    # kept compiles after it. With it the probes' summaries compile on a thread (where the devices take them).
    # Started after the step's trace, so their own trace takes the interpreter while XLA compiles or loads the
    # step, not while the step is traced. No `prepare`: a loop that takes none (the plain Orbax baseline).
    prepared = prepare(program.abstract_state) if prepare is not None else None
    lowered.compile()
    if prepared is not None:
        logging.info("save marks' fingerprints: %s (process %d)", prepared.result(), jax.process_index())
    if fresh:
        program.init_fn.lower().compile()


def open_checkpointer(config: TrainConfig, mesh, watchdog: Watchdog | None = None,
                      inputs: data.Inputs | None = None, workdir: Workdir | None = None,
                      traced: dict[str, str] | None = None) -> Checkpointer:
    """This run's Checkpointer: its identity is the config (its fixed names may not change on a resume)
    with, on record files, the dataset's identity (its digest may not change either), and the code that
    computes it (config["code"], trainer/code.py); the verifier replays it with
    trainer.program:replay_program. Without `watchdog` it owns one of --watchdog_secs, stopped at close.
    `workdir`: the start-up's one open of --workdir, if the caller read it already; `traced`: the config's
    computation (trainer/program.py), if the caller traced it already."""
    workdir = workdir if workdir is not None else Workdir(config.workdir)
    recorded = inputs.recorded() if inputs is not None else {}
    fixed = tuple(model_config.fixed_names(config)) + (inputs.fixed_names() if inputs is not None else ())
    identity = {**config.to_json(), **recorded, CODE_FIELD: resumed_code(config, workdir, traced)}
    return Checkpointer(workdir, config.checkpoint, config=identity, fixed=fixed,
                        mesh=mesh, total_steps=config.steps, program=REPLAY_PROGRAM, watchdog=watchdog,
                        watchdog_secs=config.watchdog_secs)


def check_resumed_data(config: TrainConfig, inputs: data.Inputs, workdir: Workdir) -> None:
    """A resume reads the files its checkpoints were trained and evaluated on: DatasetChangedError (exit 2,
    one line, nothing written) names the first field or file that differs from the newest readable manifest's
    (their content included), unless --accept_data_change accepts it (data.check_resumed)."""
    if config.checkpoint.resume_from == "none":
        return
    for step in reversed(workdir.committed_steps()):
        try:
            manifest = workdir.read_manifest(step)
        except Exception:  # an unreadable manifest is the restore's to handle (it falls back past it)
            continue
        data.check_resumed(manifest.get("config", {}), inputs, config, step)
        return


def resumed_code(config: TrainConfig, workdir: Workdir, traced: dict[str, str] | None = None) -> dict:
    """This process's code identity, checked against the newest committed manifest's (one warning line
    naming what changed, logged once the run is admitted; a ConfigError under --refuse_code_change).
    `traced`: the config's computation, traced here when not given."""
    current = code_lib.identity(config, traced if traced is not None else computation(config))
    try:
        steps = workdir.committed_steps()
        previous = workdir.read_manifest(steps[-1])["config"] if steps else None
    except Exception:  # noqa: BLE001  an unreadable workdir is the Checkpointer's to report, with its own line
        return current
    return code_lib.check_resume(config, previous, current)


def train(config: TrainConfig, startup_phases: dict[str, float] | None = None,
          opened_at: float | None = None, open_parts: OpenParts | None = None) -> TrainResult:
    """Trains up to `config.steps`, resuming per --resume_from and saving per the config.

    `startup_phases` are the entry point's own phases (process start, distributed start-up), logged
    with the loop's (open: from `opened_at`, a perf_counter, or this call, to the compile; compile,
    restore, first step) as `phase <name> <secs>s` lines.

    Opening the Checkpointer checks the resume request (read only) and takes the workdir's lease before
    anything is written (a refused trainer leaves the workdir as it was); it is released on every exit.
    """
    opened_at = time.perf_counter() if opened_at is None else opened_at
    open_parts = OpenParts(opened_at) if open_parts is None else open_parts  # the entry point's, marked so far
    with matmul_precision(config.matmul_precision):
        return _open_and_train(config, startup_phases, opened_at, open_parts)


@contextlib.contextmanager
def matmul_precision(value: str):
    """--matmul_precision for everything this process computes until the run ends (the step and init are
    also traced at it, trainer/program.py; here the eval and the manifests' platform record see it too);
    the process's previous setting afterwards, for a caller that trains in-process."""
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", jax_precision(value))
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", previous)


def _open_and_train(config: TrainConfig, startup_phases: dict[str, float] | None, opened_at: float,
                    open_parts: OpenParts) -> TrainResult:
    mesh = build_mesh(config)
    # The record files are opened and checked first: a bad glob or file, or other files than the
    # checkpoints were trained on, is refused before the Checkpointer takes the lease (nothing written).
    inputs = data.open_inputs(models.resolve(config.model), config, mesh)
    open_parts.mark("inputs")
    watchdog = None
    try:
        workdir = Workdir(config.workdir)  # one open for the whole start-up: each manifest read once
        if os.path.isdir(workdir) or is_object_store(workdir):
            check_resumed_data(config, inputs, workdir)
        open_parts.mark("resume_check")
        # What computes the numbers, traced abstractly from the functions build_program compiles next (its cost
        # against the compile: benchmarks/compile_bench.py); the code identity a resume is checked by.
        begin = time.perf_counter()
        traced = computation(config)
        phases = {**(startup_phases or {}), "computation": time.perf_counter() - begin}
        open_parts.mark("computation")
        watchdog = Watchdog(config.watchdog_secs)
        with open_checkpointer(config, mesh, watchdog, inputs, workdir, traced) as checkpointer:
            open_parts.mark("checkpointer")
            # Logged once the run is admitted: a refused run prints its one error line and nothing else.
            for name, secs in phases.items():
                log_phase(name, secs)
            inputs.log_admitted()
            changed = checkpointer.run.config[CODE_FIELD].get("changed_from")
            if changed and jax.process_index() == 0:  # recorded in every manifest of this attempt
                logging.warning("code changed since the newest checkpoint: %s", "; ".join(changed))
            return _train(config, mesh, checkpointer, watchdog, inputs, opened_at, open_parts)
    finally:
        if watchdog is not None:
            watchdog.stop()
        inputs.close()


def _train(config: TrainConfig, mesh, checkpointer: Checkpointer, watchdog: Watchdog,
           inputs: data.Inputs | None, opened_at: float, open_parts: OpenParts) -> TrainResult:
    program = build_program(config, mesh, inputs)
    if jax.process_index() == 0:
        logging.info("model %s on mesh %s (%d processes), %d steps", config.model,
                     format_mesh(config.mesh), jax.process_count(), config.steps)
    open_parts.mark("program")
    log_phase("open", time.perf_counter() - opened_at)
    open_parts.log()
    begin = time.perf_counter()
    compile_program(program, fresh=not checkpointer.resume_candidates, prepare=checkpointer.prepare)
    log_phase("compile", time.perf_counter() - begin)
    begin = time.perf_counter()
    start = checkpointer.restore_or_init(program.abstract_state, program.init_fn)
    state = jax.block_until_ready(start.state)
    log_phase("restore", time.perf_counter() - begin)
    loss_log = LossLog(config.workdir, attempt={"resumed_from": start.step, "tier": start.tier,
                                                "layout": layout_of(config.mesh_shape(), jax.process_count())})
    began = time.perf_counter()
    watchdog.pet(f"step {start.step + 1} (compiles the step)")
    evaluator = Evaluator(program) if config.eval_every_steps else None
    state = run_steps(program, state, start.step, config.steps, loss_log, on_step=checkpointer.on_step,
                      evaluator=evaluator)
    jax.block_until_ready(state)
    checkpointer.close()  # waits for the last save to commit (or raises AsyncSaveError)
    elapsed = time.perf_counter() - began
    ran = max(config.steps - start.step, 0)
    result = TrainResult(losses=loss_log.losses, state=state, steps_per_sec=ran / max(elapsed, 1e-9))
    if jax.process_index() == 0 and ran:
        # "steps 0..20": the counter went from 0 to 20; the final loss is step 19's (the update 19 -> 20).
        logging.info("done: steps %d..%d, final loss %.6f, %.2f steps/s", start.step, config.steps,
                     result.losses[config.steps - 1], result.steps_per_sec)
    return result
