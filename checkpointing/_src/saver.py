"""The per-step save: takes the preemption decision once, asks the schedule, saves to a tier.

Persistent saves go to the workdir when the schedule says (steps, seconds, `auto`, final); local
saves go to each host's own tier at its cadence, never at a step saved persistently. At a
preemption the local tier is written first (fast), then a persistent copy if its predicted commit
still fits the grace period; then Preempted (exit 75) once it committed. Each call returns a
SaveEvent saying what happened: the caller never inspects the saver's state.
"""

import dataclasses
import time

import jax
from absl import logging

from checkpointing._src import local_tier
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import marking
from checkpointing.errors import AsyncSaveError, one_line_cause
from checkpointing._src.probe_recorder import ProbeRecorder
from checkpointing._src.schedule import SaveSchedule
from checkpointing._src.service import CheckpointService
from runtime.exit_codes import Preempted
from runtime.preemption import PreemptionWatch
from runtime.watchdog import Watchdog


class PreemptedUnsaved(Preempted):
    """Preempted at `step`, and a save was not started: its commit could not fit the grace period."""

    def __init__(self, step: int, why: str):
        super().__init__(step, f"preempted at step {step}; not saved ({why})")


@dataclasses.dataclass(frozen=True)
class SaveEvent:
    """What one `on_step` call did."""

    step: int  # the step it was called for (the state's step counter)
    reason: str | None = None  # why a save of `step` started: interval, time, final, preemption; None: no save
    tier: str | None = None  # where that save went: "persistent" or "local"
    blocking_secs: float = 0.0  # how long the call blocked the loop for that save (0 without one)
    committed: tuple[int, ...] = ()  # persistent steps whose commit this call observed
    commit_secs: tuple[float, ...] = ()  # recent persistent commit durations, newest last

    @property
    def saved(self) -> bool:
        return self.reason is not None


class LossRecord:
    """Losses since the last persistent save, kept on device until a save needs them (one transfer)."""

    def __init__(self, carried: dict[int, float] | None = None, start_step: int = 0):
        self._pending: list[tuple[int, jax.Array]] = []
        self._host = dict(carried or {})
        self._since = min(self._host, default=start_step)

    def add(self, step: int, loss) -> None:
        if loss is not None:
            self._pending.append((step, loss))

    def until(self, step: int) -> dict[int, float]:
        """Every loss of steps [last persistent save, `step`): what a save of `step` records. A local
        step records them too, so a resume from it and the persistent saves after it miss none."""
        if self._pending:
            values = jax.device_get([loss for _, loss in self._pending])
            self._host.update({s: float(v) for (s, _), v in zip(self._pending, values)})
            self._pending.clear()
        return {s: v for s, v in self._host.items() if self._since <= s < step}

    def persisted(self, step: int) -> None:
        """The persistent save of `step` committed: the losses before it are in its manifest."""
        self._host = {s: v for s, v in self._host.items() if s >= step}
        self._since = step


class Saver:
    """Checks the last background save, decides once per step, saves. See the module docstring.

    When the recent commits (p90) would not fit the grace period it starts no save that would be
    killed half way: it raises PreemptedUnsaved at once and the latest committed step stays.
    """

    def __init__(self, service: CheckpointService, schedule: SaveSchedule, *, start_step: int, end_step: int,
                 preemption: PreemptionWatch, watchdog: Watchdog, local: CheckpointService | None = None,
                 carried_losses: dict[int, float] | None = None, probes: ProbeRecorder | None = None,
                 clock=time.perf_counter):
        self._service = service
        self._local = local
        self._local_failures = 0  # local saves that failed on this host (logged once)
        self.schedule = schedule
        self._end_step = end_step
        self._preemption = preemption
        self._watchdog = watchdog
        self._clock = clock
        self._save_started: float | None = None
        self._last_tick = clock()
        self._last_saved = start_step  # the newest step saved persistently (or resumed)
        self._last_local: int | None = None
        self.losses = LossRecord(carried_losses, start_step)
        self._probes = probes  # what the verifier's cheap proof compares against (checkpointing/_src/probes.py)
        self._metrics: dict[str, dict[str, float]] = {}  # {step: {name: value}} since the last persistent save
        self._marked = None  # this step's fingerprints, dispatched by on_step as the state came in

    def marks_due(self, step: int) -> tuple[bool, bool]:
        """(fingerprints, summaries): the marks of the state of `step` (checkpointing/_src/marking.py): its
        fingerprints when a save of `step` is certain (a step cadence, the final step, the local tier's
        cadence), its summaries when a probe window ends there on the devices. The same on every process."""
        fingerprints = step != self._last_saved and (
            bool(self.schedule.reason_known_ahead(step, final=step == self._end_step))
            or (self._local is not None and self.schedule.local_due(step)))
        return fingerprints, self._probes is not None and self._probes.summaries_due(step)

    def on_step(self, step: int, state, loss=None, metrics: dict | None = None) -> SaveEvent:
        # First, before anything here can block: the marks a save or a probe of this step will read.
        self._marked, summaries = marking.dispatch(state, *self.marks_due(step))
        now = self._clock()
        self._watchdog.pet(f"step {step + 1}")
        self._service.check_for_errors()
        self._check_local()
        writing = self._service.saving()
        committed = ()
        if self._save_started is not None and not writing:
            committed = (self._last_saved,)
            self._committed(now)
        self.schedule.step_ended(now - self._last_tick, writing=writing)
        if loss is not None:
            self.losses.add(step - 1, loss)
            if self._probes is not None:
                self._probes.add_loss(step - 1, loss)
        if self._probes is not None:
            self._probes.on_step(step, state, summaries)
        if metrics:
            self._metrics[str(step)] = {name: float(value) for name, value in metrics.items()}
        if self._preemption.decide(step) and step != self._end_step:
            self._preempt(step, state)  # raises Preempted
        reason, tier = self.schedule.reason(step, final=step == self._end_step), manifest_lib.PERSISTENT
        started = self._clock()
        if reason and step != self._last_saved:
            committed += self._save(step, state, reason)
        elif self._local is not None and self.schedule.local_due(step):
            reason, tier = "interval", manifest_lib.LOCAL
            self._save_local(step, state, reason)
        else:
            reason = None
        self._last_tick = self._clock()  # the next step's time excludes this call's own blocking
        return SaveEvent(step=step, reason=reason, tier=tier if reason else None,
                         blocking_secs=self._last_tick - started if reason else 0.0, committed=committed,
                         commit_secs=tuple(self.schedule.commit_secs))

    def close(self) -> None:
        """Waits for the last persistent save (AsyncSaveError if it failed), then the local one's
        (whose failure is one error line, never the run's)."""
        self._service.close()
        if self._save_started is not None and jax.process_index() == 0:
            logging.info("checkpoint: step %d committed in %.3fs (save() to commit, at close)", self._last_saved,
                         self._clock() - self._save_started)
        if self._probes is not None:
            if self._save_started is not None:
                self._probes.committed(self._last_saved)
            self._probes.close()
        if self._local is not None:
            try:
                self._local.close()
            except (AsyncSaveError, OSError) as err:
                self._local_failed(err)

    def _check_local(self) -> None:
        """A local tier's background failure (a full RAM disk) is one error line on that host: the
        step is then not complete on every host, so no resume uses it. Never fatal."""
        if self._local is not None:
            try:
                self._local.check_for_errors()
            except (AsyncSaveError, OSError) as err:
                self._local_failed(err)

    def _save(self, step: int, state, reason: str) -> tuple[int, ...]:
        """Starts the save of `step`; returns the previous save's step if this call saw it commit."""
        committed = ()
        if self._save_started is not None:
            # The previous save is still writing: Orbax would wait for it inside save() anyway;
            # waiting here first records its commit time instead of losing it.
            waiting = self._clock()
            self._service.wait_until_finished()
            committed = (self._last_saved,)
            self._committed(self._clock(), waited=self._clock() - waiting)
        losses = self.losses.until(step)
        started = self._clock()
        self._service.save(step, state, losses=losses, reason=reason, extra=self._extra(), fingerprints=self._marked)
        self._metrics = {}
        if self._probes is not None:
            self._probes.saved(step)
        self._save_started = started
        self.schedule.save_started(self._clock() - started)
        self._last_saved = step
        return committed

    def _save_local(self, step: int, state, reason: str) -> None:
        """Starts a local save. Never fatal: Orbax re-raises the previous local write's failure (a full
        RAM disk) inside this save(), and a failure here is one error line on this host naming the
        local path; the persistent tier goes on and no resume uses the step (not complete everywhere)."""
        try:
            self._local.save(step, state, losses=self.losses.until(step), reason=reason, extra=self._extra(),
                             fingerprints=self._marked)
        except (AsyncSaveError, OSError) as err:
            self._local_failed(err)
        self.schedule.local_saved()
        self._last_local = step

    def _local_failed(self, err: Exception) -> None:
        """One error line per host for a failing local tier, naming its path; never the run's failure."""
        if not self._local_failures:
            logging.error("local tier %s: %s; training goes on with the persistent tier (no resume uses a "
                          "local step that failed; later local failures are not logged)", self._local.directory,
                          one_line_cause(err))
        self._local_failures += 1

    def _local_committed_everywhere(self, step: int) -> bool:
        """Collective: whether every host committed `step` locally (after waiting for its own save)."""
        try:
            self._local.wait_until_finished()
        except (AsyncSaveError, OSError) as err:
            self._local_failed(err)
        return step in local_tier.complete_local_steps(self._local)

    def _preempt(self, step: int, state) -> None:
        """Saves `step` where it fits the grace period, then raises Preempted: the local tier first
        (fast, on every host), then a persistent copy if its predicted commit fits the time left."""
        grace = self.schedule.grace_secs
        started, saved_locally = self._clock(), False
        if self._local is not None:
            if self._last_local != step and self._last_saved != step:
                self._save_local(step, state, "preemption")
            with self._watchdog.bounded(f"committing the local preemption checkpoint of step {step}", grace):
                saved_locally = self._local_committed_everywhere(step)
        if step != self._last_saved:
            why = self.schedule.unfitting_save(grace - (self._clock() - started))
            if why is None:
                self._save(step, state, "preemption")
            elif not saved_locally:
                latest = self._service.latest_committed_step()
                logging.warning("preemption at step %d: starting no save: %s; the latest committed step %s stays",
                                step, why, latest)
                raise PreemptedUnsaved(step, f"{why}; the latest committed step {latest} stays")
            else:
                logging.warning("preemption at step %d: saved on every host's local tier; no persistent copy: %s",
                                step, why)
        if self._last_saved == step:
            left = max(grace - (self._clock() - started), 1e-3)
            with self._watchdog.bounded(f"committing the preemption checkpoint of step {step}", left):
                self._service.wait_until_finished()
        raise Preempted(step)

    def _extra(self) -> dict:
        """The manifest's `extra`: the schedule's history, and the caller's metrics (eval losses, say)
        of every step since the last persistent save, as {"<step>": {name: value}}."""
        extra = self.schedule.manifest_extra()
        if self._metrics:
            extra["metrics"] = dict(self._metrics)
        return extra

    def _committed(self, now: float, waited: float | None = None) -> None:
        """The save in flight committed (seen at this step boundary, or `waited` for by the next save): record its
        time, adapt."""
        self.schedule.committed(now - self._save_started)
        if jax.process_index() == 0:  # the hand-off line's partner: what a write-bound cadence pays per save
            logging.info("checkpoint: step %d committed in %.3fs (save() to commit)%s", self._last_saved,
                         now - self._save_started, "" if waited is None else f" (the next save waited {waited:.3f}s)")
        self._save_started = None
        if self._probes is not None:
            self._probes.committed(self._last_saved)
        # Only now may its losses go: until this commit, a local step (or the next persistent save, if
        # this one fails) must still record them, or a crash before the commit would lose them.
        self.losses.persisted(self._last_saved)
