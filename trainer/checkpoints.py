"""The trainer's side of the checkpoint service: what to restore at start-up and when to save.

Restore precedence (MaxText's rule, made strict):
  --resume_from=latest           this workdir's newest committed step; if it cannot be read back
                                 (corrupt), the next newest, with an error log line; nothing: fresh.
  --resume_from=latest_verified  the newest step whose verdict passed (same fallback); refuses a
                                 workdir that has checkpoints but no passing verdict.
  --resume_from=STEP             exactly that step, or exit 2.
  --resume_from=none             fresh, and refuses a workdir that already has checkpoints.
Committed steps newer than the one resumed (unverified, failed or corrupt) are never deleted: they
are moved to <workdir>/superseded/ so the resumed run can save its own steps under those numbers.
"""

import jax
from absl import logging

from checkpointing import verdicts
from checkpointing.errors import (BadCheckpointRequest, CorruptCheckpointError, FingerprintMismatchError,
                                  ManifestError, NoSuchCheckpointError)
from checkpointing.policy import SavePolicy
from checkpointing.service import (CheckpointOptions, CheckpointService, RunMetadata, check_config_matches,
                                   committed_steps, read_manifest)
from launch.preemption import Preempted, PreemptionWatch
from launch.watchdog import Watchdog
from trainer.config import TrainConfig
from trainer.program import Program


def run_metadata(config: TrainConfig, program: Program) -> RunMetadata:
    return RunMetadata(config=config.to_json(), fixed_fields=config.fixed_fields(),
                       fixed_hash=config.fixed_hash(), mesh=dict(program.mesh.shape))


def open_service(config: TrainConfig, program: Program, **kwargs) -> CheckpointService:
    options = CheckpointOptions(save_every_steps=config.save_every_steps, save_every_secs=config.save_every_secs,
                                max_to_keep=config.max_to_keep, keep_every_steps=config.keep_every_steps,
                                async_save=config.async_save)
    # Retention never deletes the newest step the verifier has proved.
    protected = lambda: [step for step in [verdicts.newest_verified_step(config.workdir)] if step is not None]
    return CheckpointService(config.workdir, options, run=run_metadata(config, program), protected_steps=protected,
                             **kwargs)


def resume_candidates(config: TrainConfig) -> list[int]:
    """Committed steps to try, in order ([] means start fresh); checked before anything runs.

    Reads only the directory listing, the verdicts and one manifest, so a bad request fails
    before any compile, log line or write.
    """
    committed = committed_steps(config.workdir)
    if config.resume_from == "none":
        if committed:
            raise BadCheckpointRequest(
                f"--resume_from=none but {config.workdir} already has committed steps {committed}; "
                "use a new --workdir or --resume_from=latest")
        return []
    if config.resume_from == "latest":
        candidates = committed[::-1]
    elif config.resume_from == "latest_verified":
        candidates = [step for step in verdicts.passed_steps(config.workdir) if step in committed][::-1]
        if committed and not candidates:
            raise BadCheckpointRequest(
                f"--resume_from=latest_verified: none of the committed steps {committed} has a passing verdict; "
                "run python -m trainer.verify or use --resume_from=latest")
    else:
        step = int(config.resume_from)
        if step not in committed:
            raise NoSuchCheckpointError(f"--resume_from={step}: not a committed step (committed: {committed or 'none'})")
        if committed[-1] > step:
            raise BadCheckpointRequest(
                f"--resume_from={step}: newer steps {[s for s in committed if s > step]} exist and would be "
                "overwritten; resume into a new --workdir")
        candidates = [step]
    if candidates:
        fixed = RunMetadata(config={}, fixed_fields=config.fixed_fields(), fixed_hash=config.fixed_hash(), mesh={})
        try:
            check_config_matches(candidates[0], read_manifest(config.workdir, candidates[0]), fixed)
        except ManifestError:
            pass  # an unreadable manifest is corruption: restore_or_init falls back past it
    return candidates


def restore_or_init(program: Program, service: CheckpointService, candidates: list[int]):
    """(start_step, state): the first candidate that restores intact, or a fresh init at step 0.

    Only an explicit --resume_from=STEP (a single candidate) fails on a corrupt step; otherwise
    the corrupt step is set aside and the next candidate tried.
    """
    for index, step in enumerate(candidates):
        try:
            restored = service.restore(step, program.abstract_state)
            if int(restored.state.step) != step:
                raise CorruptCheckpointError(f"step {step}: its state's step counter reads {int(restored.state.step)}")
        except (CorruptCheckpointError, FingerprintMismatchError, ManifestError) as err:
            if len(candidates) == 1 and program.config.resume_from not in ("latest", "latest_verified"):
                raise
            logging.error("checkpoint step %d cannot be restored (%s); falling back to %s", step, err,
                          f"step {candidates[index + 1]}" if index + 1 < len(candidates) else "a fresh start")
            continue
        newer = [s for s in service.committed_steps() if s > step]
        if newer:
            logging.warning("resuming from step %d; setting aside newer steps %s in %s/superseded", step, newer,
                            service.directory)
            service.set_aside(newer)
        if jax.process_index() == 0:
            logging.info("resumed from step %d (saved on mesh %s)", step, restored.manifest["mesh"])
        return step, restored.state
    if candidates:
        service.set_aside(service.committed_steps())
    if jax.process_index() == 0:
        logging.info("no checkpoint to resume in %s: starting from step 0", service.directory)
    return 0, program.init_fn()


class Saver:
    """The loop's per-step hook: checks the last background save, decides once, saves.

    On a preemption decision it saves that step (if not saved already), waits for the commit
    within the grace period (the watchdog exits 1 otherwise, leaving the previous step latest)
    and raises Preempted; the entry point turns that into the "requeue me" exit code.
    """

    def __init__(self, service: CheckpointService, policy: SavePolicy, *, start_step: int, end_step: int,
                 preemption: PreemptionWatch, watchdog: Watchdog, grace_secs: float):
        self._service = service
        self._policy = policy
        self._end_step = end_step
        self._preemption = preemption
        self._watchdog = watchdog
        self._grace_secs = grace_secs
        self.last_saved_step = start_step

    def __call__(self, step: int, state, loss_log):
        self._watchdog.pet(f"step {step + 1}")
        self._service.check_for_errors()
        preempted = self._preemption.decide(step) and step != self._end_step
        reason = self._policy.reason(step, final=step == self._end_step, preempted=preempted)
        if reason and step != self.last_saved_step:
            loss_log.flush()
            losses = {s: v for s, v in loss_log.losses.items() if self.last_saved_step <= s < step}
            self._service.save(step, state, losses=losses, reason=reason)
            self._policy.saved()
            self.last_saved_step = step
        if preempted:
            with self._watchdog.bounded(f"committing the preemption checkpoint of step {step}", self._grace_secs):
                self._service.wait_until_finished()
            raise Preempted(step)
        return state
