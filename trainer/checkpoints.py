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
Committed steps newer than the one resumed (unverified, failed or corrupt) are never deleted: they
are moved to <workdir>/superseded/ so the resumed run can save its own steps under those numbers.
"""

import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from checkpointing import verdicts
from checkpointing.errors import (BadCheckpointRequest, CorruptCheckpointError, FingerprintMismatchError,
                                  ManifestError, NoSuchCheckpointError)
from checkpointing.policy import AutoInterval, SavePolicy, mean_time_between_interruptions, p90
from checkpointing.service import (CheckpointOptions, CheckpointService, RunMetadata, check_config_matches,
                                   committed_steps, read_manifest)
from runtime.exit_codes import Preempted
from runtime.preemption import PreemptionWatch
from runtime.watchdog import Watchdog
from trainer.config import AUTO, TrainConfig
from trainer.program import Program


def run_metadata(config: TrainConfig, program: Program) -> RunMetadata:
    return RunMetadata(config=config.to_json(), fixed_fields=config.fixed_fields(),
                       fixed_hash=config.fixed_hash(), mesh=dict(program.mesh.shape))


def open_service(config: TrainConfig, program: Program, **kwargs) -> CheckpointService:
    secs = 0.0 if config.save_every_secs == AUTO else config.save_every_secs  # auto: the Saver's policy decides
    options = CheckpointOptions(save_every_steps=config.save_every_steps, save_every_secs=secs,
                                max_to_keep=config.max_to_keep, keep_every_steps=config.keep_every_steps,
                                async_save=config.async_save)
    # Retention never deletes the newest step the verifier has reproduced: the next proof starts there.
    protected = lambda: [step for step in [verdicts.newest_reproduced_step(config.workdir, committed_steps(config.workdir))]
                         if step is not None]
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
        candidates = verdicts.reproduced_steps(config.workdir, committed)[::-1]
        if committed and not candidates:
            raise BadCheckpointRequest(
                f"--resume_from=latest_verified: none of the committed steps {committed} was reproduced by the "
                "verifier; run python -m trainer.verify or use --resume_from=latest")
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
        except (ManifestError, CorruptCheckpointError):
            pass  # a missing or unreadable manifest is corruption: restore_or_init falls back past it
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
            if program.config.resume_from == "latest_verified":
                _require_proof_of_this_save(service.directory, step, restored.manifest)
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


def _require_proof_of_this_save(workdir: str, step: int, manifest: dict) -> None:
    """A verdict proves one save: the step number may have been set aside and saved again since."""
    verdict = verdicts.read(workdir, step)
    if not verdicts.is_reproduced(verdict) or verdict.get("manifest_digest") != manifest.get("digest"):
        raise CorruptCheckpointError(f"step {step}: its reproduced verdict belongs to another save of that step")


MTBI_PRIOR_SECS = 3600.0  # before any interruption is seen: assume one an hour (conservative)
RECENT_COMMITS = 10  # commit times kept (and recorded in each manifest) for the deadline's p90


class PreemptedUnsaved(Preempted):
    """Preempted at `step`, and a save was not started: its commit could not fit the grace period."""

    def __init__(self, step: int, why: str):
        super().__init__(step, f"preempted at step {step}; not saved ({why})")


def make_saver(config: TrainConfig, service: CheckpointService, *, start_step: int, preemption: PreemptionWatch,
               watchdog: Watchdog) -> "Saver":
    """The Saver, seeded with the workdir's history (process 0 reads the resumed step's manifest)."""
    history = {}
    if start_step and jax.process_index() == 0:
        try:
            history = dict(service.read_manifest(start_step).get("extra") or {})
        except (ManifestError, CorruptCheckpointError):
            pass  # restore just read it; a history is only a hint
    auto = None
    if config.save_every_secs == AUTO:
        interruptions = int(history.get("interruptions", 0)) + (1 if start_step else 0)
        started_at = float(history.get("history_started_at", time.time()))
        auto = AutoInterval(mtbi_secs=mean_time_between_interruptions(interruptions, time.time() - started_at,
                                                                      MTBI_PRIOR_SECS),
                            max_overhead=config.max_save_overhead, max_interval_secs=config.max_save_interval_secs,
                            cost_secs=history.get("save_cost_secs"))
        history.update(interruptions=interruptions, history_started_at=started_at)
    policy = SavePolicy(config.save_every_steps, auto.interval() if auto else config.save_every_secs)
    return Saver(service, policy, start_step=start_step, end_step=config.steps, preemption=preemption,
                 watchdog=watchdog, grace_secs=config.preemption_grace_secs, auto=auto,
                 commit_secs=[float(x) for x in history.get("commit_secs", [])][-RECENT_COMMITS:],
                 history={k: history[k] for k in ("interruptions", "history_started_at") if k in history})


class Saver:
    """The loop's per-step hook: checks the last background save, decides once, saves.

    On a preemption decision it saves that step (if not saved already), waits for the commit
    within the grace period (the watchdog exits 1 otherwise, leaving the previous step latest)
    and raises Preempted; the entry point turns that into the "requeue me" exit code. When the
    recent commits (p90) would not fit the grace period it starts no save that would be killed
    half way: it raises PreemptedUnsaved at once and the latest committed step stays.
    """

    def __init__(self, service: CheckpointService, policy: SavePolicy, *, start_step: int, end_step: int,
                 preemption: PreemptionWatch, watchdog: Watchdog, grace_secs: float,
                 auto: AutoInterval | None = None, commit_secs: list[float] | None = None,
                 history: dict | None = None, clock=time.perf_counter):
        self._service = service
        self._policy = policy
        self._end_step = end_step
        self._preemption = preemption
        self._watchdog = watchdog
        self._grace_secs = grace_secs
        self._auto = auto
        self._history = dict(history or {})
        self._clock = clock
        self.commit_secs = list(commit_secs or [])
        self._save_started: float | None = None
        self._warned_deadline = False
        self._last_tick = clock()
        self.last_saved_step = start_step
        self._check_deadline()
        if auto is not None:
            self._log_interval(first=True)

    def __call__(self, step: int, state, loss_log):
        now = self._clock()
        self._watchdog.pet(f"step {step + 1}")
        self._service.check_for_errors()
        writing = self._service.saving()
        if self._save_started is not None and not writing:
            self._committed(now)
        if self._auto is not None:
            self._auto.step(now - self._last_tick, writing=writing)
        preempted = self._preemption.decide(step) and step != self._end_step
        if preempted and step != self.last_saved_step:
            self._refuse_unfitting_save(step)
        reason = self._policy.reason(step, final=step == self._end_step, preempted=preempted)
        if reason and step != self.last_saved_step:
            loss_log.flush()
            losses = {s: v for s, v in loss_log.losses.items() if self.last_saved_step <= s < step}
            if self._save_started is not None:
                # The previous save is still writing: Orbax would wait for it inside save() anyway;
                # waiting here first records its commit time instead of losing it.
                self._service.wait_until_finished()
                self._committed(self._clock())
            started = self._clock()
            self._service.save(step, state, losses=losses, reason=reason, extra=self._extra())
            self._save_started = started
            if self._auto is not None:
                self._auto.save_started(self._clock() - started)
            self._policy.saved()
            self.last_saved_step = step
        if preempted:
            with self._watchdog.bounded(f"committing the preemption checkpoint of step {step}", self._grace_secs):
                self._service.wait_until_finished()
            raise Preempted(step)
        self._last_tick = self._clock()  # the next step's time excludes this hook's own blocking
        return state

    def _extra(self) -> dict:
        """What this save's manifest records: recent commit times, and the auto interval's inputs."""
        extra = {"commit_secs": [round(x, 4) for x in self.commit_secs], **self._history}
        if self._auto is not None:
            extra.update(save_interval_secs=round(self._policy.save_every_secs, 3),
                         mtbi_secs=round(self._auto.mtbi_secs, 1))
            if self._auto.cost_secs is not None:
                extra["save_cost_secs"] = round(self._auto.cost_secs, 4)
        return extra

    def _committed(self, now: float) -> None:
        """The save in flight committed (seen at this step boundary): record its time, adapt."""
        self.commit_secs = (self.commit_secs + [now - self._save_started])[-RECENT_COMMITS:]
        self._save_started = None
        self._check_deadline()
        if self._auto is not None:
            self._auto.committed()
            self._log_interval()

    def _log_interval(self, first: bool = False) -> None:
        interval = self._auto.interval()
        old = self._policy.save_every_secs
        self._policy.save_every_secs = interval
        if jax.process_index() == 0 and (first or not abs(interval - old) <= 0.05 * old):
            cost = self._auto.cost_secs
            logging.info("save interval %.1fs (was %.1fs): save cost C %s, mean time between interruptions M "
                         "%.0fs, step %s, --max_save_overhead=%g, --max_save_interval_secs=%g", interval, old,
                         "unmeasured" if cost is None else f"{cost:.3f}s", self._auto.mtbi_secs,
                         "unmeasured" if self._auto.step_secs is None else f"{self._auto.step_secs:.4f}s",
                         self._auto.max_overhead, self._auto.max_interval_secs)

    def _check_deadline(self) -> None:
        predicted = p90(self.commit_secs)
        if predicted is None or predicted <= self._grace_secs or self._warned_deadline:
            return
        self._warned_deadline = True
        if jax.process_index() == 0:
            logging.warning(
                "checkpoint commits take %.2fs (p90 of the last %d) but --preemption_grace_secs=%g: a save at "
                "SIGTERM would not commit in time, so a preemption will exit without one. Raise the grace period "
                "(Slurm: --signal=TERM@<secs>; GKE: terminationGracePeriodSeconds) and --preemption_grace_secs "
                "with it, or save less state", predicted, len(self.commit_secs), self._grace_secs)

    def _refuse_unfitting_save(self, step: int) -> None:
        """Process 0 predicts the commit and every process follows its answer (a lone save would hang)."""
        predicted = p90(self.commit_secs)
        fits = predicted is None or predicted <= self._grace_secs
        if jax.process_count() > 1:
            fits = bool(multihost_utils.broadcast_one_to_all(np.int32(fits)))
        if fits:
            return
        why = (f"its commit would take about {predicted:.2f}s (p90 of the last {len(self.commit_secs)}) "
               f"> --preemption_grace_secs={self._grace_secs:g}" if predicted is not None
               else "process 0 predicted its commit would not fit --preemption_grace_secs")
        latest = self._service.latest_committed_step()
        logging.warning("preemption at step %d: starting no save: %s; the latest committed step %s stays",
                        step, why, latest)
        raise PreemptedUnsaved(step, f"{why}; the latest committed step {latest} stays")
