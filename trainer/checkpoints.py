"""The trainer's side of the checkpoint service: what to restore at start-up and when to save.

Restore precedence (MaxText's rule, made strict):
  --resume_from=latest           this workdir's newest committed step; if it cannot be read back
                                 (corrupt), the next newest, with an error log line; nothing: fresh.
  --resume_from=latest_verified  the newest step the verifier *reproduced* (its own state proved from
                                 the seed's chain of trust; an intact or replayed verdict is not
                                 enough, and no step after a failed one counts until a later step is
                                 reproduced again); same fallback; refuses a workdir that has
                                 checkpoints but no reproduced step.
  --resume_from=STEP             exactly that step, or exit 2.
  --resume_from=none             fresh, and refuses a workdir that already has checkpoints.
With --local_dir and --resume_from=latest, the newest step complete in EVERY host's local tier comes
first when it is at least the newest persistent step; a local step written by another layout (mesh,
process count) is skipped with one log line, a damaged one with an error line. A local step is never
"verified": latest_verified, STEP and none read the persistent tier only.
Committed steps newer than the one resumed (unverified, failed or corrupt) are never deleted: they
are moved to superseded/ (the workdir's, or each host's local one) so the resumed run can save its
own steps under those numbers.
"""
import dataclasses

import jax
from absl import logging

from checkpointing import local_tier, verdicts
from checkpointing import manifest as manifest_lib
from checkpointing import workdir as workdir_lib
from checkpointing.checks import check_config_matches
from checkpointing.errors import (BadCheckpointRequest, CheckpointError, CorruptCheckpointError,
                                  FingerprintMismatchError, ManifestError, NoSuchCheckpointError)
from checkpointing.service import CheckpointService, RunMetadata
from checkpointing.workdir import committed_steps, read_manifest
from trainer.config import TrainConfig
from trainer.program import Program


def run_metadata(config: TrainConfig, program: Program) -> RunMetadata:
    return RunMetadata(config=config.to_json(), fixed_fields=config.fixed_fields(),
                       fixed_hash=config.fixed_hash(), mesh=dict(program.mesh.shape))


def open_service(config: TrainConfig, program: Program, **kwargs) -> CheckpointService:
    # Retention never deletes the newest step the verifier has reproduced: the next proof starts there.
    def protected() -> list[int]:
        newest = verdicts.newest_reproduced_step(config.workdir, committed_steps(config.workdir))
        return [] if newest is None else [newest]

    return CheckpointService(config.workdir, config.checkpoint, run=run_metadata(config, program),
                             protected_steps=protected, **kwargs)


def open_local_service(config: TrainConfig, program: Program, **kwargs) -> CheckpointService | None:
    """This process's local tier (its own --local_dir), or None without one."""
    if not config.checkpoint.local_dir:
        return None
    directory = workdir_lib.expand_local_dir(config.checkpoint.local_dir, jax.process_index())
    local = dataclasses.replace(config.checkpoint, max_to_keep=config.checkpoint.local_max_to_keep, keep_every_steps=0)
    return CheckpointService(directory, local, run=run_metadata(config, program), tier=manifest_lib.LOCAL, **kwargs)


def resume_candidates(config: TrainConfig) -> list[int]:
    """Committed steps to try, in order ([] means start fresh); checked before anything runs.

    Reads only the directory listing, the verdicts and one manifest, so a bad request fails
    before any compile, log line or write.
    """
    committed = committed_steps(config.workdir)
    if config.checkpoint.resume_from == "none":
        if committed:
            raise BadCheckpointRequest(
                f"--resume_from=none but {config.workdir} already has committed steps {committed}; "
                "use a new --workdir or --resume_from=latest")
        return []
    if config.checkpoint.resume_from == "latest":
        candidates = committed[::-1]
    elif config.checkpoint.resume_from == "latest_verified":
        candidates = verdicts.reproduced_steps(config.workdir, committed)[::-1]
        if committed and not candidates:
            raise BadCheckpointRequest(
                f"--resume_from=latest_verified: none of the committed steps {committed} was reproduced by the "
                "verifier; run python -m trainer.verify or use --resume_from=latest")
    else:
        step = int(config.checkpoint.resume_from)
        if step not in committed:
            raise NoSuchCheckpointError(
                f"--resume_from={step}: not a committed step (committed: {committed or 'none'})")
        if committed[-1] > step:
            raise BadCheckpointRequest(
                f"--resume_from={step}: newer steps {[s for s in committed if s > step]} exist and would be "
                "overwritten; resume into a new --workdir")
        candidates = [step]
    if candidates:
        fixed = RunMetadata(config={}, fixed_fields=config.fixed_fields(), fixed_hash=config.fixed_hash(), mesh={})
        try:
            check_config_matches(candidates[0], read_manifest(config.workdir, candidates[0]), fixed)
        except (ManifestError, CorruptCheckpointError):
            pass  # a missing or unreadable manifest is corruption: restore_or_init falls back past it
    return candidates


def restore_or_init(program: Program, service: CheckpointService, candidates: list[int],
                    local: CheckpointService | None = None) -> tuple[int, object, str | None]:
    """(start_step, state, tier): the first candidate that restores intact (the local tier's first,
    see the module docstring), or a fresh init at step 0 (tier None).

    Only an explicit --resume_from=STEP (a single candidate) fails on a corrupt step; otherwise
    the corrupt step is set aside and the next candidate tried.
    """
    resumed = _restore_local(program, local, newest_persistent=candidates[0] if candidates else -1)
    if resumed is None:
        resumed = _restore_persistent(program, service, candidates)
    step, state, tier = resumed
    if local is not None:
        newer = [s for s in local_tier.any_local_steps(local) if s > step]  # collective: every process
        if newer:
            logging.warning("setting aside local steps %s above the resumed step %d", newer, step)
            local.set_aside(newer)
    if tier is None and jax.process_index() == 0:
        logging.info("no checkpoint to resume in %s: starting from step 0", service.directory)
    return resumed


def _restore_local(program: Program, local: CheckpointService | None, newest_persistent: int):
    if local is None or program.config.checkpoint.resume_from != "latest":
        return None
    why = local_tier.other_layout(local, program.abstract_state)  # collective
    if why is not None:
        logging.warning("local tier: its steps were written on another layout, resuming from the persistent "
                        "tier (%s)", why)
        return None
    steps = [s for s in local_tier.complete_local_steps(local)[::-1] if s >= newest_persistent]
    for step in steps:
        try:
            restored = local.restore(step, program.abstract_state)
            _check_step_counter(step, restored.state)
        except local_tier.LocalLayoutMismatchError as err:
            logging.warning("local tier: steps %s were written on another layout, resuming from the persistent "
                            "tier (%s)", steps, err)
            return None
        except CheckpointError as err:  # damaged or unreadable on some host: the next candidate
            logging.error("local checkpoint step %d cannot be restored (%s); falling back to %s", step, err,
                          "an older local step" if step != steps[-1] else "the persistent tier")
            continue
        if jax.process_index() == 0:
            logging.info("resumed from step %d (local), saved on mesh %s", step, restored.manifest["mesh"])
        return step, restored.state, manifest_lib.LOCAL
    return None


def _restore_persistent(program: Program, service: CheckpointService, candidates: list[int]):
    for index, step in enumerate(candidates):
        try:
            restored = service.restore(step, program.abstract_state)
            _check_step_counter(step, restored.state)
            if program.config.checkpoint.resume_from == "latest_verified":
                _require_proof_of_this_save(service.directory, step, restored.manifest)
        except (CorruptCheckpointError, FingerprintMismatchError, ManifestError) as err:
            if len(candidates) == 1 and program.config.checkpoint.resume_from not in ("latest", "latest_verified"):
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
            logging.info("resumed from step %d (persistent), saved on mesh %s", step, restored.manifest["mesh"])
        return step, restored.state, manifest_lib.PERSISTENT
    if candidates:
        service.set_aside(service.committed_steps())
    return 0, program.init_fn(), None


def _check_step_counter(step: int, state) -> None:
    if int(state.step) != step:
        raise CorruptCheckpointError(f"step {step}: its state's step counter reads {int(state.step)}")


def _require_proof_of_this_save(workdir: str, step: int, manifest: dict) -> None:
    """A verdict proves one save: the step number may have been set aside and saved again since."""
    verdict = verdicts.read(workdir, step)
    if not verdicts.is_reproduced(verdict) or verdict.get("manifest_digest") != manifest.get("digest"):
        raise CorruptCheckpointError(f"step {step}: its reproduced verdict belongs to another save of that step")
