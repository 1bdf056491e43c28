"""When to save, and to which tier: the loop's per-step hook (Saver) and its policy's inputs.

Persistent saves go to the workdir at --save_every_steps/--save_every_secs (or the 'auto' interval);
local saves go to each host's --local_dir at --local_save_every_steps, never at a step that is
saved persistently. At a preemption the local tier is written first (fast), then a persistent copy
if its predicted commit still fits the grace period.
"""

import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from checkpointing import local_tier
from checkpointing import manifest as manifest_lib
from checkpointing.config import AUTO
from checkpointing.errors import AsyncSaveError, CorruptCheckpointError, ManifestError
from checkpointing.policy import AutoInterval, SavePolicy, mean_time_between_interruptions, p90
from checkpointing.service import CheckpointService
from runtime.exit_codes import Preempted
from runtime.preemption import PreemptionWatch
from runtime.watchdog import Watchdog
from trainer.config import TrainConfig

MTBI_PRIOR_SECS = 3600.0  # before any interruption is seen: assume one an hour (conservative)
RECENT_COMMITS = 10  # commit times kept (and recorded in each manifest) for the deadline's p90


class PreemptedUnsaved(Preempted):
    """Preempted at `step`, and a save was not started: its commit could not fit the grace period."""

    def __init__(self, step: int, why: str):
        super().__init__(step, f"preempted at step {step}; not saved ({why})")


def make_saver(config: TrainConfig, service: CheckpointService, local: CheckpointService | None, *,
               start_step: int, resumed_tier: str | None, preemption: PreemptionWatch, watchdog: Watchdog) -> "Saver":
    """The Saver, seeded with the run's history (process 0 reads the resumed step's manifest)."""
    history, resumed_reason = {}, None
    if start_step and jax.process_index() == 0:
        try:
            resumed = local if resumed_tier == manifest_lib.LOCAL else service
            manifest = resumed.read_manifest(start_step)
            history, resumed_reason = dict(manifest.get("extra") or {}), manifest.get("reason")
        except (ManifestError, CorruptCheckpointError):
            pass  # restore just read it; a history is only a hint
    auto = None
    if config.checkpoint.save_every_secs == AUTO:
        # Young/Daly's M is the time between interruptions that lose work. A resume from a
        # preemption save, or a run extended past its final step, lost none: it does not count.
        lost_work = bool(start_step) and resumed_reason not in ("preemption", "final")
        interruptions = int(history.get("interruptions", 0)) + int(lost_work)
        started_at = float(history.get("history_started_at", time.time()))
        auto = AutoInterval(mtbi_secs=mean_time_between_interruptions(interruptions, time.time() - started_at,
                                                                      MTBI_PRIOR_SECS),
                            max_overhead=config.checkpoint.max_save_overhead,
                            max_interval_secs=config.checkpoint.max_save_interval_secs,
                            cost_secs=history.get("save_cost_secs"))
        history.update(interruptions=interruptions, history_started_at=started_at)
    history = {k: history[k] for k in ("interruptions", "history_started_at") if k in history}
    if resumed_tier is not None:
        history["resumed_from"] = {"step": start_step, "tier": resumed_tier}
    policy = SavePolicy(config.checkpoint.save_every_steps,
                        auto.interval() if auto else config.checkpoint.fixed_save_every_secs)
    local_saves = None if local is None else LocalSaves(local, SavePolicy(config.checkpoint.local_save_every_steps))
    carried = {}
    if resumed_tier == manifest_lib.LOCAL:  # every process reads its own copy: the same losses everywhere
        carried = manifest_lib.losses(local.read_manifest(start_step))
    return Saver(service, policy, start_step=start_step, end_step=config.steps, preemption=preemption,
                 watchdog=watchdog, grace_secs=config.checkpoint.preemption_grace_secs, auto=auto,
                 commit_secs=[float(x) for x in history.get("commit_secs", [])][-RECENT_COMMITS:],
                 history=history, local=local_saves, carried_losses=carried)


class LocalSaves:
    """The local tier's saves: frequent, and never fatal. A background failure (a full RAM disk) is
    one error line on that host; the step is then not complete on every host, so no resume uses it."""

    def __init__(self, service: CheckpointService, policy: SavePolicy):
        self.service = service
        self.policy = policy
        self.last_step: int | None = None

    def check(self) -> None:
        try:
            self.service.check_for_errors()
        except AsyncSaveError as err:
            logging.error("local tier: %s; training goes on (no resume will use that step)", err)

    def save(self, step: int, state, losses: dict[int, float], reason: str, extra: dict) -> None:
        self.service.save(step, state, losses=losses, reason=reason, extra=extra)
        self.policy.saved()
        self.last_step = step

    def committed_everywhere(self, step: int) -> bool:
        """Collective: whether every host committed `step` locally (after waiting for its own save)."""
        try:
            self.service.wait_until_finished()
        except AsyncSaveError as err:
            logging.error("local tier: %s", err)
        return step in local_tier.complete_local_steps(self.service)

    def close(self) -> None:
        try:
            self.service.close()
        except AsyncSaveError as err:
            logging.error("local tier: %s", err)


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
                 history: dict | None = None, local: LocalSaves | None = None,
                 carried_losses: dict[int, float] | None = None, clock=time.perf_counter):
        self._service = service
        self._local = local
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
        # A resume from a local step carries the losses its manifest recorded since the last persistent
        # save, so the next persistent save records every step since that one.
        self._carried = dict(carried_losses or {})
        self._losses_from = min(self._carried, default=start_step)
        self._check_deadline()
        if auto is not None:
            self._log_interval(first=True)

    def __call__(self, step: int, state, loss_log):
        now = self._clock()
        self._watchdog.pet(f"step {step + 1}")
        self._service.check_for_errors()
        if self._local is not None:
            self._local.check()
        writing = self._service.saving()
        if self._save_started is not None and not writing:
            self._committed(now)
        if self._auto is not None:
            self._auto.step(now - self._last_tick, writing=writing)
        if self._preemption.decide(step) and step != self._end_step:
            self._preempt(step, state, loss_log)  # raises Preempted
        reason = self._policy.reason(step, final=step == self._end_step)
        if reason and step != self.last_saved_step:
            self._save(step, state, loss_log, reason)
        elif self._local is not None and self._local.policy.reason(step):
            loss_log.flush()
            self._local.save(step, state, self._losses(loss_log, step), "interval", self._extra())
        self._last_tick = self._clock()  # the next step's time excludes this hook's own blocking
        return state

    def close_local(self) -> None:
        """Waits for the last local save; its failure is one error line, never the run's."""
        if self._local is not None:
            self._local.close()

    def _losses(self, loss_log, step: int) -> dict[int, float]:
        """Every loss since the last persistent save: a local step carries them too, so a resume from
        it and the persistent saves after it still record every step."""
        return {s: v for s, v in {**self._carried, **loss_log.losses}.items() if self._losses_from <= s < step}

    def _save(self, step: int, state, loss_log, reason: str) -> None:
        loss_log.flush()
        losses = self._losses(loss_log, step)
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
        self.last_saved_step = self._losses_from = step
        self._carried = {}

    def _preempt(self, step: int, state, loss_log) -> None:
        """Saves `step` where it fits the grace period, then raises Preempted: the local tier first
        (fast, on every host), then a persistent copy if its predicted commit fits the time left."""
        started, saved_locally = self._clock(), False
        if self._local is not None:
            if self._local.last_step != step and self.last_saved_step != step:
                loss_log.flush()
                self._local.save(step, state, self._losses(loss_log, step), "preemption", self._extra())
            with self._watchdog.bounded(f"committing the local preemption checkpoint of step {step}",
                                        self._grace_secs):
                saved_locally = self._local.committed_everywhere(step)
        if step != self.last_saved_step:
            left = self._grace_secs - (self._clock() - started)
            why = self._unfitting_save(left)
            if why is None:
                self._save(step, state, loss_log, "preemption")
            elif not saved_locally:
                latest = self._service.latest_committed_step()
                logging.warning("preemption at step %d: starting no save: %s; the latest committed step %s stays",
                                step, why, latest)
                raise PreemptedUnsaved(step, f"{why}; the latest committed step {latest} stays")
            else:
                logging.warning("preemption at step %d: saved on every host's local tier; no persistent copy: %s",
                                step, why)
        if self.last_saved_step == step:
            left = max(self._grace_secs - (self._clock() - started), 1e-3)
            with self._watchdog.bounded(f"committing the preemption checkpoint of step {step}", left):
                self._service.wait_until_finished()
        raise Preempted(step)

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

    def _unfitting_save(self, seconds_left: float) -> str | None:
        """Why a persistent save would not commit in `seconds_left`, or None if it fits. Process 0
        predicts it from recent commits and every process follows its answer (a lone save would hang)."""
        predicted = p90(self.commit_secs)
        fits = predicted is None or predicted <= seconds_left
        if jax.process_count() > 1:
            fits = bool(multihost_utils.broadcast_one_to_all(np.int32(fits)))
        if fits:
            return None
        if predicted is None:
            return "process 0 predicted its commit would not fit --preemption_grace_secs"
        return (f"its commit would take about {predicted:.2f}s (p90 of the last {len(self.commit_secs)}) "
                f"> the {seconds_left:.2f}s left of --preemption_grace_secs={self._grace_secs:g}")
