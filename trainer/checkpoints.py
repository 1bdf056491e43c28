"""The trainer's side of the checkpoint service: what to restore at start-up and when to save.

Restore precedence (MaxText's rule, made strict): --resume_from=latest restores this workdir's
newest committed step, or starts fresh if there is none; --resume_from=STEP restores exactly that
step or fails; --resume_from=none starts fresh and refuses a workdir that already has checkpoints
(it would overwrite them).
"""

import jax
from absl import logging

from checkpointing.errors import BadCheckpointRequest, CorruptCheckpointError, NoSuchCheckpointError
from checkpointing.policy import SavePolicy
from checkpointing.service import (CheckpointOptions, CheckpointService, RunMetadata, check_config_matches,
                                   committed_steps, read_manifest)
from trainer.config import TrainConfig
from trainer.program import Program


def run_metadata(config: TrainConfig, program: Program) -> RunMetadata:
    return RunMetadata(config=config.to_json(), fixed_fields=config.fixed_fields(),
                       fixed_hash=config.fixed_hash(), mesh=dict(program.mesh.shape))


def open_service(config: TrainConfig, program: Program, **kwargs) -> CheckpointService:
    options = CheckpointOptions(save_every_steps=config.save_every_steps, save_every_secs=config.save_every_secs,
                                max_to_keep=config.max_to_keep, keep_every_steps=config.keep_every_steps,
                                async_save=config.async_save)
    return CheckpointService(config.workdir, options, run=run_metadata(config, program), **kwargs)


def resume_step(config: TrainConfig) -> int | None:
    """The committed step --resume_from asks for (None: start fresh), checked before anything runs.

    Reads only the directory listing and one manifest, so a bad request fails before any
    compile, log line or write.
    """
    committed = committed_steps(config.workdir)
    if config.resume_from == "none":
        if committed:
            raise BadCheckpointRequest(
                f"--resume_from=none but {config.workdir} already has committed steps {committed}; "
                "use a new --workdir or --resume_from=latest")
        return None
    if config.resume_from == "latest":
        step = committed[-1] if committed else None
    else:
        step = int(config.resume_from)
        if step not in committed:
            raise NoSuchCheckpointError(f"--resume_from={step}: not a committed step (committed: {committed or 'none'})")
        if committed[-1] > step:
            raise BadCheckpointRequest(
                f"--resume_from={step}: newer steps {[s for s in committed if s > step]} exist and would be "
                "overwritten; resume into a new --workdir")
    if step is not None:
        fixed = RunMetadata(config={}, fixed_fields=config.fixed_fields(), fixed_hash=config.fixed_hash(), mesh={})
        check_config_matches(step, read_manifest(config.workdir, step), fixed)
    return step


def restore_or_init(program: Program, service: CheckpointService, step: int | None):
    """(start_step, state): `step` restored onto the program's mesh, or a fresh init at step 0."""
    if step is None:
        if jax.process_index() == 0:
            logging.info("no checkpoint to resume in %s: starting from step 0", service.directory)
        return 0, program.init_fn()
    restored = service.restore(step, program.abstract_state)
    if int(restored.state.step) != step:
        raise CorruptCheckpointError(f"step {step}: its state's step counter reads {int(restored.state.step)}")
    if jax.process_index() == 0:
        logging.info("resumed from step %d (saved on mesh %s)", step, restored.manifest["mesh"])
    return step, restored.state


class Saver:
    """The loop's per-step hook: checks the last background save, decides, saves."""

    def __init__(self, service: CheckpointService, policy: SavePolicy, *, start_step: int, end_step: int):
        self._service = service
        self._policy = policy
        self._end_step = end_step
        self.last_saved_step = start_step

    def __call__(self, step: int, state, loss_log):
        self._service.check_for_errors()
        reason = self._policy.reason(step, final=step == self._end_step)
        if reason and step != self.last_saved_step:
            loss_log.flush()
            losses = {s: v for s, v in loss_log.losses.items() if self.last_saved_step <= s < step}
            self._service.save(step, state, losses=losses, reason=reason)
            self._policy.saved()
            self.last_saved_step = step
        return state
