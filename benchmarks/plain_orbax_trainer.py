"""The goodput benchmark's baseline: this trainer's step with a plain Orbax CheckpointManager.

  python -m launch.local --module=benchmarks.plain_orbax_trainer -- --workdir=DIR [trainer flags] [--plain_save]

What a user would write: the same program (`trainer.program`), data and loop (`trainer.loop.run_steps`)
with an async `ocp.CheckpointManager` saving the state at the same steps (every
--save_every_steps, the final step, and the preemption step), and restoring the latest step. No
manifest, no fingerprints, no lease, no verifier. With --noplain_save it saves nothing at all (the
benchmark's `ideal` run). It logs the same `phase <name> <secs>s` lines as the trainer.
Exit 0 done, 75 preempted (the preemption step committed).
"""

from runtime import entry, distributed  # first, and without JAX (see distributed.hold_sigterm)

if __name__ == "__main__":
    distributed.hold_sigterm()

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import flags, logging  # noqa: E402

from checkpointing import SaveEvent  # noqa: E402
from checkpointing._src import workdir as workdir_lib  # noqa: E402
from runtime import exit_codes  # noqa: E402
from trainer import flags as trainer_flags  # noqa: E402
from trainer import loop  # noqa: E402
from trainer.program import build_mesh, build_program, validate  # noqa: E402
from trainer import compile_cache  # noqa: E402
from trainer.train import process_start_time  # noqa: E402

PLAIN_SAVE = flags.DEFINE_boolean("plain_save", True, "Save with a plain CheckpointManager (false: never save).")


class _Manager(ocp.CheckpointManager):
    """Asks the runtime about preemption once per step: Orbax asks again inside save(), and a second
    sync-point call for one step can answer differently on one host (see runtime/preemption.py)."""

    _decision: tuple[int, bool] = (-1, False)

    def reached_preemption(self, step: int) -> bool:
        if self._decision[0] != step:
            self._decision = (step, super().reached_preemption(step))
        return self._decision[1]


class _Saver:
    """run_steps' per-step hook: save at the interval, the end and a preemption; exit on preemption."""

    def __init__(self, manager: _Manager | None, every: int, end_step: int, start_step: int):
        self._manager, self._every, self._end = manager, every, end_step
        self.last_saved_step = start_step

    def __call__(self, step: int, state, loss) -> SaveEvent | None:
        if self._manager is None:
            return None
        preempted = jax.process_count() > 1 and self._manager.reached_preemption(step)
        due = step == self._end or (self._every and step % self._every == 0)
        event = None
        if (due or preempted) and step != self.last_saved_step:
            started = time.perf_counter()
            self._manager.wait_until_finished()  # what save() does first: timed apart, as the service's Saver does
            waited = time.perf_counter() - started
            self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
            reason = "preemption" if preempted else "final" if step == self._end else "interval"
            event = SaveEvent(step=step, reason=reason, tier="persistent", blocking_secs=time.perf_counter() - started)
            if jax.process_index() == 0:  # the service's line: the benchmark reads both the same way
                logging.info("checkpoint: step %d (%s) handed off in %.3fs (%.3fs of it waiting for the previous "
                             "commit)", step, reason, event.blocking_secs, waited)
            self.last_saved_step = step
        if preempted and step != self._end:
            self._manager.wait_until_finished()
            logging.warning("preempted at step %d; its checkpoint committed", step)
            sys.exit(exit_codes.PREEMPTED)
        return event


def train(config, phases: dict[str, float], opened_at: float, parts: loop.OpenParts) -> None:
    for name, secs in phases.items():
        loop.log_phase(name, secs)
    program = build_program(config, build_mesh(config))
    parts.mark("program")
    manager = None
    if PLAIN_SAVE.value:
        manager = _Manager(workdir_lib.checkpoints_dir(config.workdir), options=ocp.CheckpointManagerOptions(
            max_to_keep=config.checkpoint.max_to_keep, enable_async_checkpointing=True))
    latest = manager.latest_step() if manager is not None else None
    parts.mark("checkpointer")
    loop.log_phase("open", time.perf_counter() - opened_at)  # as the trainer's: to the compile
    parts.log()
    begin = time.perf_counter()
    loop.compile_program(program, fresh=latest is None)  # plain Orbax takes no fingerprints
    loop.log_phase("compile", time.perf_counter() - begin)
    begin = time.perf_counter()
    if latest is None:
        start_step, state = 0, program.init_fn()
    else:
        start_step = latest
        if jax.process_index() == 0:
            logging.info("resumed from step %d", latest)
        state = manager.restore(latest, args=ocp.args.StandardRestore(program.abstract_state))
    jax.block_until_ready(state)
    loop.log_phase("restore", time.perf_counter() - begin)
    saver = _Saver(manager, config.checkpoint.save_every_steps, config.steps, start_step)
    start = time.perf_counter()
    state = loop.run_steps(program, state, start_step, config.steps, loop.LossLog(config.workdir), on_step=saver)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if jax.process_index() == 0:
        ran = config.steps - start_step
        logging.info("done: steps %d..%d, %.2f steps/s", start_step, config.steps,
                     ran / max(time.perf_counter() - start, 1e-9))


def main(argv: list[str]) -> None:
    started, phases = time.time(), {}
    if (process_started := process_start_time()) is not None:
        phases["process_start"] = max(started - process_started, 0.0)
    begin = time.perf_counter()
    distributed.initialize()
    phases["distributed_start"] = time.perf_counter() - begin
    opened_at = time.perf_counter()
    parts = loop.OpenParts(opened_at)  # the trainer's parts of `open`, as far as this trainer has them
    device_count = jax.device_count()
    parts.mark("devices")
    config = validate(trainer_flags.config_from_flags(), device_count)
    parts.mark("validate")
    cache_dir = trainer_flags.COMPILATION_CACHE_DIR.value
    compile_cache.use(compile_cache.default_dir() if cache_dir is None else cache_dir)
    parts.mark("workdir")
    train(config, phases, opened_at, parts)


if __name__ == "__main__":
    entry.run(main)
