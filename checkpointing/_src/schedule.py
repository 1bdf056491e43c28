"""The whole save decision of one run: the cadence (steps, seconds, or `auto`), the run's history
across restarts, and whether a save still fits the preemption deadline.

checkpointing/_src/policy.py holds the pieces (SavePolicy, Young/Daly, AutoInterval); this composes them
from a CheckpointConfig and the history the newest manifest carried, and says what the next
manifest must carry on. The Saver asks it, and only it, when to save.
"""

import time

from absl import logging

from checkpointing.config import AUTO, CheckpointConfig
from checkpointing._src.policy import AutoInterval, SavePolicy, mean_time_between_interruptions, p90
from runtime import collective

MTBI_PRIOR_SECS = 3600.0  # before any interruption is seen: assume one an hour (conservative)
RECENT_COMMITS = 10  # commit times kept (and recorded in each manifest) for the deadline's p90
# What a manifest's `extra` carries from one attempt of the run to the next.
_CARRIED = ("interruptions", "history_started_at")


class SaveSchedule:
    """When to save, decided identically on every process; the clock is injectable for tests."""

    def __init__(self, config: CheckpointConfig, *, resumed_step: int = 0, resumed_manifest: dict | None = None,
                 resumed_tier: str | None = None, clock=time.perf_counter, wall_clock=time.time):
        history = dict((resumed_manifest or {}).get("extra") or {})
        resumed_reason = (resumed_manifest or {}).get("reason")
        self.grace_secs = config.preemption_grace_secs
        self._clock = clock
        self.auto = None
        if config.save_every_secs == AUTO:
            # Young/Daly's M is the time between interruptions that lose work. A resume from a
            # preemption save, or a run extended past its final step, lost none: it does not count.
            lost_work = bool(resumed_step) and resumed_reason not in ("preemption", "final")
            interruptions = int(history.get("interruptions", 0)) + int(lost_work)
            started_at = float(history.get("history_started_at", wall_clock()))
            self.auto = AutoInterval(
                mtbi_secs=mean_time_between_interruptions(interruptions, wall_clock() - started_at, MTBI_PRIOR_SECS),
                max_overhead=config.max_save_overhead, max_interval_secs=config.max_save_interval_secs,
                cost_secs=history.get("save_cost_secs"))
            history.update(interruptions=interruptions, history_started_at=started_at)
        self.commit_secs = [float(x) for x in history.get("commit_secs", [])][-RECENT_COMMITS:]
        self._history = {k: history[k] for k in _CARRIED if k in history}
        if resumed_tier is not None:
            self._history["resumed_from"] = {"step": resumed_step, "tier": resumed_tier}
        self.policy = SavePolicy(config.save_every_steps,
                                 self.auto.interval() if self.auto else config.fixed_save_every_secs, clock=clock)
        self.local_policy = SavePolicy(config.local_save_every_steps, clock=clock)
        self._warned_deadline = False
        self._check_deadline()
        if collective.is_primary():
            line = first_save_line(config, resumed_step, self.auto.interval() if self.auto else None)
            logging.log(logging.WARNING if line.startswith("no save") else logging.INFO, "%s", line)
        if self.auto is not None:
            self._log_interval(first=True)

    def reason(self, step: int, *, final: bool) -> str | None:
        """Why `step` is saved persistently (final, interval, time), or None."""
        return self.policy.reason(step, final=final)

    def reason_known_ahead(self, step: int, *, final: bool) -> str | None:
        """`reason(step)` where it is known before the step runs (final, the step cadence); None for a
        time-based save, which is decided at the step itself."""
        every = self.policy.save_every_steps  # not policy.reason: its time check is a collective, made at the step
        return "final" if final else "interval" if every and step % every == 0 else None

    def local_due(self, step: int) -> bool:
        return bool(self.local_policy.reason(step))

    def step_ended(self, secs: float, *, writing: bool) -> None:
        """One step's wall time (without the save hook's own blocking) for the auto interval's cost."""
        if self.auto is not None:
            self.auto.step(secs, writing=writing)

    def save_started(self, blocking_secs: float) -> None:
        self.policy.saved()
        if self.auto is not None:
            self.auto.save_started(blocking_secs)

    def local_saved(self) -> None:
        self.local_policy.saved()

    def committed(self, secs: float) -> None:
        """A persistent save committed after `secs`: recorded, and the interval adapts."""
        self.commit_secs = (self.commit_secs + [secs])[-RECENT_COMMITS:]
        self._check_deadline()
        if self.auto is not None:
            self.auto.committed()
            self._log_interval()

    def unfitting_save(self, seconds_left: float) -> str | None:
        """Why a persistent save would not commit in `seconds_left`, or None if it fits. Process 0
        predicts it from recent commits and every process follows its answer (a lone save would hang)."""
        predicted = p90(self.commit_secs)
        if collective.decided_by_primary(lambda: predicted is None or predicted <= seconds_left):
            return None
        if predicted is None:
            return "process 0 predicted its commit would not fit --preemption_grace_secs"
        return (f"its commit would take about {predicted:.2f}s (p90 of the last {len(self.commit_secs)}) "
                f"> the {seconds_left:.2f}s left of --preemption_grace_secs={self.grace_secs:g}")

    def manifest_extra(self) -> dict:
        """What the next save's manifest records: recent commit times, the history, the auto inputs."""
        extra = {"commit_secs": [round(x, 4) for x in self.commit_secs], **self._history}
        if self.auto is not None:
            extra.update(save_interval_secs=round(self.policy.save_every_secs, 3),
                         mtbi_secs=round(self.auto.mtbi_secs, 1))
            if self.auto.cost_secs is not None:
                extra["save_cost_secs"] = round(self.auto.cost_secs, 4)
        return extra

    def _log_interval(self, first: bool = False) -> None:
        interval, old = self.auto.interval(), self.policy.save_every_secs
        self.policy.save_every_secs = interval
        if collective.is_primary() and (first or not abs(interval - old) <= 0.05 * old):
            cost = self.auto.cost_secs
            logging.info("save interval %.1fs (was %.1fs): save cost C %s, mean time between interruptions M "
                         "%.0fs, step %s, --max_save_overhead=%g, --max_save_interval_secs=%g", interval, old,
                         "unmeasured" if cost is None else f"{cost:.3f}s", self.auto.mtbi_secs,
                         "unmeasured" if self.auto.step_secs is None else f"{self.auto.step_secs:.4f}s",
                         self.auto.max_overhead, self.auto.max_interval_secs)

    def _check_deadline(self) -> None:
        predicted = p90(self.commit_secs)
        if predicted is None or predicted <= self.grace_secs or self._warned_deadline:
            return
        self._warned_deadline = True
        if collective.is_primary():
            logging.warning(
                "checkpoint commits take %.2fs (p90 of the last %d) but --preemption_grace_secs=%g: a save at "
                "SIGTERM would not commit in time, so a preemption will exit without one. Raise the grace period "
                "(Slurm: --signal=TERM@<secs>; GKE: terminationGracePeriodSeconds) and --preemption_grace_secs "
                "with it, or save less state", predicted, len(self.commit_secs), self.grace_secs)


def first_save_line(config: CheckpointConfig, start_step: int, auto_secs: float | None) -> str:
    """The start-up line that says when the first persistent save comes."""
    when = []
    if config.save_every_steps:
        when.append(f"at step {(start_step // config.save_every_steps + 1) * config.save_every_steps} "
                    f"(--save_every_steps={config.save_every_steps})")
    if auto_secs is not None:
        when.append(f"within {auto_secs:.0f}s (--save_every_secs=auto; then the interval that maximises goodput)")
    elif config.fixed_save_every_secs:
        when.append(f"within {config.fixed_save_every_secs:g}s (--save_every_secs)")
    if not when:
        return ("no save before the final step or a preemption (--save_every_steps=0, --save_every_secs=0): "
                "a crash loses every step of this attempt")
    return "first checkpoint " + ", or ".join(when) + ", whichever comes first"
