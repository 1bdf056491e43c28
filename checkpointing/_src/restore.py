"""What a start-up restores, and from which tier (the restore precedence, MaxText's rule made strict):

  resume_from=latest           this workdir's newest committed step; if it is corrupt (evidence: its
                               fingerprints, tree, manifest, a file truncated or missing, or a complete
                               `fail` verdict of this save), the next newest, with an error log line;
                               none at all: fresh. A read that fails for the storage (EIO, the network)
                               is retried, then exit 1 (reads.py): never a fallback; and committed steps
                               that all fail are exit 1, not step 0.
  resume_from=latest_verified  the newest step the verifier *reproduced* (proved from the seed's chain
                               of trust, its verdict naming this save's manifest digest); same fallback;
                               refuses a workdir that has checkpoints but no reproduced step.
  resume_from=STEP             exactly that step, or exit 2; refused while newer steps exist unless
                               rollback (--rollback): then they are set aside, as below.
  resume_from=none             fresh, and refuses a workdir that already has checkpoints; with
                               rollback, sets every committed step aside and starts from step 0.
With a local tier and resume_from=latest, the newest step complete in EVERY host's local tier comes
first when it is at least the newest persistent step; a local step written by another layout (mesh,
process count) is skipped with one log line, a damaged one with an error line. A local step is never
"verified": latest_verified, STEP and none read the persistent tier only.
A run asked for fewer --steps than the step it would resume is refused (exit 2, nothing changed).
Committed steps newer than the one resumed (unverified, failed or corrupt) are never deleted: they
are moved to superseded/ (the workdir's, or each host's local one) so the resumed run can save its
own steps under those numbers. A fresh start with init_from takes its params from another run's step.
"""

import dataclasses
from typing import Callable

from absl import logging

from checkpointing._src import content, local_tier, verdicts
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import partial
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.checks import check_config_matches
from checkpointing.config import CheckpointConfig
from checkpointing.errors import (BadCheckpointRequest, CheckpointError, ConfigMismatchError,
                                  CorruptCheckpointError, FingerprintMismatchError, ManifestError,
                                  NoSuchCheckpointError)
from checkpointing._src.service import CheckpointService, RunMetadata
from runtime import collective


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a start-up got: the step it starts at, its state, and where that came from."""

    step: int  # 0 for a fresh start
    state: object
    tier: str | None  # "persistent", "local", or None (a fresh init)
    manifest: dict | None  # the restored step's manifest (read once), None for a fresh init


def resume_candidates(workdir: str, options: CheckpointConfig, run: RunMetadata,
                      total_steps: int | None = None) -> list[int]:
    """Committed steps to try, in order ([] means start fresh); checked before anything runs.

    Reads only the directory listing, the verdicts and one manifest, so a bad request fails
    before any compile, log line or write.
    """
    for link, target in workdir_lib.linked_steps(workdir).items():
        raise BadCheckpointRequest(f"{link} is a symbolic link to {target}: a run's steps must be its own "
                                   "directories (retention deletes them); replace it by a copy, or remove it")
    committed = workdir_lib.committed_steps(workdir)
    if options.rollback and not (options.resume_from.isdigit() or options.resume_from == "none"):
        raise BadCheckpointRequest(f"--rollback needs --resume_from=STEP (the step to roll back to) or none (to "
                                   f"step 0), got --resume_from={options.resume_from}")
    if options.resume_from == "none":
        if committed and not options.rollback:
            raise BadCheckpointRequest(f"--resume_from=none but {workdir} already has committed steps {committed}; "
                                       "use a new --workdir, --resume_from=latest, or add --rollback to start over "
                                       "from step 0 (they move to superseded/ with their verdicts)")
        return []
    if options.resume_from == "latest":
        candidates = committed[::-1]
    elif options.resume_from == "latest_verified":
        candidates = verdicts.proved_steps(workdir, committed)[::-1]
        if committed and not candidates:
            raise BadCheckpointRequest(
                f"--resume_from=latest_verified: none of the committed steps {committed} was reproduced by the "
                "verifier; run python -m verifier.verify or use --resume_from=latest")
    else:
        step = int(options.resume_from)
        if step not in committed:
            raise NoSuchCheckpointError(
                f"--resume_from={step}: not a committed step (committed: {committed or 'none'})")
        if committed[-1] > step and not options.rollback:
            raise BadCheckpointRequest(
                f"--resume_from={step}: newer steps {[s for s in committed if s > step]} exist; to roll back "
                "to it add --rollback (they move to superseded/ with their verdicts), or resume into a new --workdir")
        candidates = [step]
    if total_steps is not None and candidates and candidates[0] > total_steps:
        raise BadCheckpointRequest(f"--steps={total_steps}: the run in {workdir} is already at step {candidates[0]}; "
                                   "nothing changed (give --steps above it to train on)")
    if candidates and options.resume_from != "latest_verified":  # that one falls back past a refused step
        try:
            check_config_matches(candidates[0], workdir_lib.read_manifest(workdir, candidates[0]), run)
        except (ManifestError, CorruptCheckpointError):
            pass  # a missing or unreadable manifest is corruption: restore_or_init falls back past it
    return candidates


def init_from(workdir: str, requested: str) -> dict | None:
    """The other run's step a run in `workdir` starts from: `requested` (--init_from=WORKDIR[:STEP]) resolved,
    or (once the run has steps) what its newest manifest recorded; a relaunch naming another source is refused."""
    committed = workdir_lib.committed_steps(workdir)
    recorded = None
    for step in reversed(committed):  # the newest readable manifest: a damaged one is the restore's to skip
        try:
            recorded = workdir_lib.read_manifest(workdir, step).get("init_from")
            break
        except CheckpointError:
            continue
    if not requested:
        return recorded
    source, _, step_text = requested.rpartition(":")
    if not (source and step_text.isdigit()):
        source, step_text = requested, ""
    if committed:
        if recorded is None or recorded["workdir"] != source or step_text and int(step_text) != recorded["step"]:
            raise BadCheckpointRequest(f"--init_from={requested}: {workdir} already holds steps "
                                       f"{committed} started from {recorded or 'the seed'}")
        return recorded
    steps = workdir_lib.committed_steps(source)
    step = int(step_text) if step_text else (steps[-1] if steps else None)
    if step is None or step not in steps:
        raise NoSuchCheckpointError(f"--init_from={requested}: not a committed step of {source} "
                                    f"(committed: {steps or 'none'})")
    return {"workdir": source, "step": step, "digest": workdir_lib.read_manifest(source, step)["digest"]}


def restore_or_init(options: CheckpointConfig, service: CheckpointService, local: CheckpointService | None,
                    candidates: list[int], abstract_state, init_fn: Callable[[], object],
                    init_from: dict | None = None) -> RestoreResult:
    """The first candidate that restores intact (the local tier's first, see the module docstring),
    or a fresh init at step 0 (with `init_from`'s params). Only an explicit resume_from=STEP (a single
    candidate) fails on a corrupt step; otherwise the corrupt step is set aside and the next tried."""
    resumed = _restore_local(options, local, abstract_state, newest_persistent=candidates[0] if candidates else -1)
    if resumed is None:
        resumed = _restore_persistent(options, service, candidates, abstract_state)
    if resumed is None and options.rollback:  # --resume_from=none --rollback: back to step 0, deliberately
        steps = service.committed_steps()
        if steps:
            logging.warning("--resume_from=none --rollback: setting aside steps %s in %s/superseded", steps,
                            service.directory)
            service.set_aside(steps)
    if resumed is None:
        resumed = RestoreResult(0, fresh_state(init_fn, abstract_state, init_from), None, None)
        if collective.is_primary():
            logging.info("no checkpoint to resume in %s: starting from step 0%s", service.directory,
                         f" with the params of step {init_from['step']} of {init_from['workdir']}" if init_from else "")
    if local is not None:
        newer = [s for s in local_tier.any_local_steps(local) if s > resumed.step]  # collective: every process
        if newer:
            logging.warning("setting aside local steps %s above the resumed step %d", newer, resumed.step)
            local.set_aside(newer)
    return resumed


def fresh_state(init_fn: Callable[[], object], abstract_state, init_from: dict | None):
    """init_fn()'s state; with `init_from`, its params replaced by that step's (fingerprints checked)."""
    state = init_fn()
    if not init_from:
        return state
    params, manifest = partial.restore_subtree(init_from["workdir"], init_from["step"], "params",
                                               subtree(abstract_state, "params"))
    if manifest["digest"] != init_from["digest"]:
        raise CorruptCheckpointError(f"--init_from: step {init_from['step']} of {init_from['workdir']} is not the "
                                     f"save this run started from (digest {manifest['digest'][:12]} != recorded "
                                     f"{init_from['digest'][:12]})")
    return with_subtree(state, "params", params)


def subtree(tree, name: str):
    return tree[name] if isinstance(tree, dict) else getattr(tree, name)


def with_subtree(tree, name: str, value):
    """`tree` with its `name` field or key replaced (a flax struct, a dataclass or a dict)."""
    if isinstance(tree, dict):
        return {**tree, name: value}
    if hasattr(tree, "replace"):
        return tree.replace(**{name: value})
    return dataclasses.replace(tree, **{name: value})


def _restore_local(options: CheckpointConfig, local: CheckpointService | None, abstract_state,
                   newest_persistent: int) -> RestoreResult | None:
    if local is None or options.resume_from != "latest":
        return None
    why = local_tier.other_layout(local, abstract_state)  # collective
    if why is not None:
        logging.warning("local tier: its steps were written on another layout, resuming from the persistent "
                        "tier (%s)", why)
        return None
    steps = [s for s in local_tier.complete_local_steps(local)[::-1] if s >= newest_persistent]
    for step in steps:
        try:
            restored = local.restore(step, abstract_state)
            check_step_counter(step, restored.state)
        except local_tier.LocalLayoutMismatchError as err:
            logging.warning("local tier: steps %s were written on another layout, resuming from the persistent "
                            "tier (%s)", steps, err)
            return None
        except CheckpointError as err:  # damaged or unreadable on some host: the next candidate
            logging.error("local checkpoint step %d cannot be restored (%s); falling back to %s", step, err,
                          "an older local step" if step != steps[-1] else "the persistent tier")
            continue
        if collective.is_primary():
            logging.info("resumed from step %d (local), saved on mesh %s", step, restored.manifest["mesh"])
        return RestoreResult(step, restored.state, manifest_lib.LOCAL, restored.manifest)
    return None


def _restore_persistent(options: CheckpointConfig, service: CheckpointService, candidates: list[int],
                        abstract_state) -> RestoreResult | None:
    failures = []
    for index, step in enumerate(candidates):
        try:
            if options.resume_from == "latest":
                _refuse_failed_verdict(service.directory, step)
            restored = service.restore(step, abstract_state)
            check_step_counter(step, restored.state)
            _check_what_its_verdict_proved(service.directory, step, restored,
                                           required=options.resume_from == "latest_verified")
        except (CorruptCheckpointError, FingerprintMismatchError, ManifestError, ConfigMismatchError) as err:
            # latest_verified falls back past a step saved by another config, down to the oldest one
            if isinstance(err, ConfigMismatchError) and (options.resume_from != "latest_verified"
                                                         or index + 1 == len(candidates)):
                raise
            if len(candidates) == 1 and options.resume_from not in ("latest", "latest_verified"):
                raise
            failures.append(str(err))
            if index + 1 < len(candidates):
                logging.error("checkpoint step %d cannot be restored (%s); falling back to step %d", step, err,
                              candidates[index + 1])
            continue
        newer = [s for s in service.committed_steps() if s > step]
        if newer:
            logging.warning("resuming from step %d; setting aside newer steps %s in %s/superseded", step, newer,
                            service.directory)
            service.set_aside(newer)
        if collective.is_primary():
            logging.info("resumed from step %d (persistent), saved on mesh %s", step, restored.manifest["mesh"])
        return RestoreResult(step, restored.state, manifest_lib.PERSISTENT, restored.manifest)
    if candidates:  # committed steps, none restorable: a run never goes back to step 0 unless told to
        raise CorruptCheckpointError(
            f"no committed step of {service.directory} can be restored ({'; '.join(failures)}); nothing was set "
            "aside; to start this workdir over from step 0, run with --resume_from=none --rollback (they move to "
            "superseded/)")
    return None


def check_step_counter(step: int, state) -> None:
    """A state with a step counter (`.step` or `['step']`) must hold the step it was saved as."""
    counter = state.get("step") if isinstance(state, dict) else getattr(state, "step", None)
    if counter is not None and int(counter) != step:
        raise CorruptCheckpointError(f"step {step}: its state's step counter reads {int(counter)}")


def _refuse_failed_verdict(workdir: str, step: int) -> None:
    """A step the verifier failed (a complete `fail` of this save: evidence) is not resumed from, as a corrupt
    one is not; `inconclusive` or `error` say nothing against it."""
    verdict = verdicts.for_save(workdir, step)
    if verdict is not None and verdict["complete"] and verdict["status"] == "fail":
        raise CorruptCheckpointError(f"step {step}: the verifier failed it ({verdict['level']} fail: "
                                     f"{verdict['detail']})")


def _check_what_its_verdict_proved(workdir: str, step: int, restored, required: bool) -> None:
    """A verdict proves one save (its manifest digest: the step number may have been set aside and saved again
    since) and one content (its leaves' sha256, checkpointing/_src/content.py: arrays edited after the proof, the
    manifest untouched, match the fingerprints but not these). `required` (latest_verified): a step without
    such a verdict is refused too. Every process takes process 0's answer (it holds every leaf it checks)."""
    verdict = verdicts.for_save(workdir, step, restored.manifest.get("digest"))
    if required and not verdicts.is_proved(verdict):
        raise CorruptCheckpointError(f"step {step}: its verdict belongs to another save of that step")
    proved = (verdict or {}).get("content_sha256") if verdicts.is_proved(verdict) else None
    changed = content.differing(restored.state, proved) if proved and collective.is_primary() else []
    if collective.decided_by_primary(lambda: bool(changed)):
        raise CorruptCheckpointError(
            f"step {step}: leaf {changed[0] if changed else '?'} is not the content its verdict proved "
            f"({len(changed) or 'some'} leaf(s) differ: edited after the proof)")
