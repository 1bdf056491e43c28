"""The verifier over a workdir: which committed steps are pending, in what order they are proved, and
the verdicts written (process 0 writes; every process restores and replays, following one plan).

Intact proofs come first, HELD_STATES steps at a time, each step restored once and held for its own
replay (verifier/proofs.py); under --follow, steps committed during a replay are proved intact
before and between its chunks and after the last (one step each on a local workdir, REPLAY_CHUNK_STEPS
on gs://), so a new commit's first verdict does not wait for it. Once HELD_STATES steps are held, a step
committed since the plan was made is still proved intact there, and its state let go: its own replay restores it
again (one more restore per new commit for a verifier that is behind, against a first verdict that
waited for whole replays; a backlog found at the start is not restored twice). While idle, --follow
lists again as soon as a local workdir's checkpoints/ or probes/ changes (verifier/commit_watch.py),
else after its backoff delay (the only signal on gs://).
Between replayed steps, a replay that may not end before the next commit (the save being written says so,
or the cadence, or it is the run's final save) waits for it instead, within a share of its replay time
(verifier/forecast.py): the commit's intact proof then finds the verifier's devices free, not behind the
replay step in progress.
It only reads checkpoints; the one thing it writes is verdicts.
"""

import threading
import time

import jax
from absl import logging

from checkpointing.verification import durable, verdicts
from checkpointing.errors import CheckpointError
from checkpointing.verification import committed_steps, read_manifest
from runtime import collective
from verifier import program as program_lib
from verifier.commit_watch import CommitWatch
from verifier.context import ProofContext
from verifier.faults import VerdictWriteError
from verifier.forecast import CommitForecast
from verifier.ledger import Ledger
from verifier.proofs import HeldStep, StepProver, VerifierOptions

# Restored, intact steps held for their replays: with the anchor, the replay's own state and the
# step being proved, at most HELD_STATES + 3 states are on the verifier's devices at once (+ 1 while a
# new commit is proved intact with HELD_STATES held).
HELD_STATES = 2
# --follow looks for new commits every this many replayed steps on gs:// (a listing and a read per
# committed step) and proves them intact at once; on a local workdir after every step, where the
# commit watch makes looking one stat.
REPLAY_CHUNK_STEPS = 2


class Stopped(Exception):
    """SIGTERM or SIGINT reached the verifier: it stops between replay chunks, writing nothing unfinished."""


class Verifier:
    """What is pending, in what order it is proved and the verdicts written (see the module docstring); each
    step's proofs are its StepProver's, whose every replay (the chain's too) is this verifier's _replay."""

    def __init__(self, options: VerifierOptions, stop: threading.Event | None = None):
        self.options = options
        self._context = ProofContext(options, self._replay)  # shared by the step's and the chain's proofs
        self._prover = StepProver(self._context)
        self._stop = stop or threading.Event()  # set by SIGTERM (verifier/verify.py)
        self._held: dict[int, HeldStep] = {}  # intact steps (verdict written) waiting for their replay
        self._intact_between_chunks = False  # --follow: prove new commits intact during a replay
        self._proving: int | None = None  # the step whose replay is running
        self._intact_only: set[int] = set()  # proved intact between chunks while HELD_STATES were held: not held
        self._planned: set[int] = set()  # the pending steps of the current plan: any other is a new commit
        self._watch: CommitWatch | None = None  # --follow, process 0: what tells it the workdir changed
        self._forecast: CommitForecast | None = None  # --follow, process 0: when to wait for a commit
        self.ledger = Ledger(options.workdir, options.reverify)  # pending, not retried, redone; the exit line

    def pending_steps(self) -> list[int]:
        return self._pending_and_proved()[0]

    def _pending_and_proved(self) -> tuple[list[int], list[int]]:
        """(committed steps without a complete verdict or named by --reverify, less those this process will
        not try again: verifier/ledger.py; committed proved steps), oldest first.

        Reads the verdicts of committed steps only (retention bounds them), never every verdict a
        long run wrote; a set-aside step's verdict has moved out with it, and a verdict counts only
        for the save its manifest digest names, so a step saved again under its number (or replaced
        after its proof) is pending again and never an anchor.
        """
        committed = committed_steps(self.options.workdir)
        found = verdicts.current_steps(self.options.workdir, committed)  # a replaced step's verdict is none
        proved = [step for step in committed if verdicts.is_proved(found.get(step))]
        return self.ledger.pending(committed, found), proved

    def verify_pending(self, max_steps: int | None = None) -> list[dict]:
        """Proves the pending steps (the oldest `max_steps` of them; None: all) once each, writes
        their verdicts and returns the complete ones."""
        plan = self._agreed_plan()
        planned = self._planned = {step for step, _ in plan}
        for step in [step for step in self._held if step not in planned]:
            del self._held[step]  # deleted or set aside since it was held
        self._intact_only &= planned
        plan = plan[:max_steps]
        written = []
        try:
            for first in range(0, len(plan), HELD_STATES):
                self._check_stop()
                written += self._prove_together(plan[first:first + HELD_STATES])
        except Stopped:
            self._mark_interrupted(planned | set(self._held) | self._intact_only)
            self._held.clear()
            logging.warning("verifier stopped: the replay in progress wrote no verdict")
        return written

    def _mark_interrupted(self, steps) -> None:
        """The intact verdicts of `steps` still waiting for a replay are marked interrupted, so no reader
        (inspect) shows a proof as running that nothing runs; complete=false still, so the next verifier
        run redoes them. Process 0 writes, as every verdict."""
        if jax.process_index() != 0:
            return
        for step in sorted(steps):
            verdict = verdicts.read(self.options.workdir, step)
            if verdict is None or verdict["complete"] or verdict["status"] == "error" or verdict.get("interrupted"):
                continue
            verdicts.write(self.options.workdir, {**verdict, "interrupted": True,
                                                  "detail": f"{verdict['detail']}; its replay was interrupted "
                                                            "(the verifier stopped): the next run redoes it"})

    def _check_stop(self) -> None:
        """Raises Stopped once SIGTERM arrived; every process stops at the same point (process 0's
        answer), so no collective restore or replay is left half-entered."""
        if collective.decided_by_primary(self._stop.is_set):
            raise Stopped()

    def _prove_together(self, plan: list[tuple[int, int | None]]) -> list[dict]:
        """Intact proofs of every step first, each verdict written as soon as it is known, then the
        replays in ascending step order: a step that committed while an older one waited gets its
        intact verdict before that one's replay. Each step is restored once, and its state held
        for its own replay."""
        written = []
        for step, _ in plan:
            verdict = self._hold_if_intact(step)
            if verdict is not None:
                written.append(verdict)
        for step, disk_anchor in plan:
            if step in self._held:  # popped: its state is released once proved
                self._proving = step
                held = self._held.pop(step)
                try:
                    verdict = self._replayed_verdict(step, held, disk_anchor)
                finally:
                    self._proving = None
                if verdict is None:  # its probe is still to come: held for the next pass
                    self._held[step] = held
                    continue
                self._write(verdict)
                written.append(verdict)
        return written

    def _replayed_verdict(self, step: int, held: HeldStep, disk_anchor: int | None) -> dict | None:
        """_prove's verdict; `gone` if the step was deleted meanwhile, wherever in the proof; `error` if the
        proof raised (never evidence once the step restored intact: verifier/faults.py)."""
        try:
            verdict = self._prove(step, held, disk_anchor)
        except (Stopped, VerdictWriteError):
            raise
        except Exception as err:  # noqa: BLE001  classified by verifier/faults.py
            return self._prover.not_proved(step, held.manifest, "reproduced", err, held.durations,
                                           evidence_possible=False)
        if verdict is not None and self._prover.deleted(step):
            return {**verdict, "status": "gone", "mismatch": None,
                    "detail": f"deleted while being verified (before its {verdict['level']} verdict was written: "
                              f"{verdict['status']}, {verdict['detail']})"}
        return verdict

    def _prove(self, step: int, held: HeldStep, disk_anchor: int | None) -> dict | None:
        return self._prover.prove(step, held, disk_anchor)  # a seam: a test deletes the step before its proof

    def _hold_if_intact(self, step: int) -> dict | None:
        """Restores `step` (unless held) and writes its intact verdict; holds its state for the
        replay and returns None, or returns the complete verdict of a step that is not intact."""
        if step in self._held:
            return None
        # Every process takes part: restores and replays are collective; process 0 writes.
        verdict, restored = self._prover.intact(step)
        if restored is None or step not in self._intact_only:  # its intact verdict is written already
            self._write(verdict)
        self._intact_only.discard(step)
        if restored is None:
            return verdict
        self._held[step] = restored
        return None

    def _replay(self, program, state, start_step: int, count: int, batches=None, perturb=None):
        """program.replay_losses in chunks; under --follow, steps committed meanwhile are proved intact
        (and held) between chunks, so their first verdict does not wait for this whole replay."""
        losses, chunk_steps = {}, self._chunk_steps()
        for first in range(start_step, start_step + count, chunk_steps):
            steps = min(chunk_steps, start_step + count - first)
            # Before every chunk, the first too: a commit made during what came before it (a probe's marked
            # step, a comparison, a copy: 1-2 s here) is proved now, not after one more replayed step.
            if self._intact_between_chunks:
                self._prove_new_commits_intact(first_chunk=first == start_step)
            self._check_stop()
            began = time.monotonic()
            state, chunk = program_lib.replay_losses(program, state, first, steps, batches, perturb)  # one iterator
            secs = time.monotonic() - began
            if self._forecast is not None:
                self._forecast.replayed(secs, steps)
            logging.vlog(1, "replayed steps %d..%d in %.2fs", first, first + steps - 1, secs)
            losses.update(chunk)
        # After the last chunk too: what follows it (a probe's marked step, the state's comparison) is
        # still a wait for a commit made meanwhile.
        if self._intact_between_chunks and count > 0:
            self._prove_new_commits_intact(first_chunk=False)
        return state, losses

    def _chunk_steps(self) -> int:
        """Replayed steps between two looks for new commits (the same on every process)."""
        return 1 if self._intact_between_chunks and durable.is_local(self.options.workdir) else REPLAY_CHUNK_STEPS

    def _prove_new_commits_intact(self, first_chunk: bool) -> None:
        # The first chunk's listing takes every pending step; after it, a step is new only if the workdir
        # changed. Process 0 may first wait for a forecast commit, then looks (its watch); the others wait
        # for its answer.
        if not collective.decided_by_primary(self._changed_or_commit_awaited) and not first_chunk:
            return
        skip = set(self._held) | {self._proving} | self._intact_only
        for step, _ in self._agreed_plan():  # every process the same plan: the restores are collective
            if step in skip:
                continue
            if len(self._held) < HELD_STATES:  # the same on every process: they follow one plan
                self._hold_if_intact(step)
                continue
            if step in self._planned:  # the backlog waits for its turn (one restore each)
                continue
            verdict, restored = self._prover.intact(step)  # a new commit's first verdict now; its state is not kept
            self._write(verdict)
            if restored is not None:
                self._intact_only.add(step)

    def _changed_or_commit_awaited(self) -> bool:
        """Process 0: whether to list again; unless a commit landed since its last look, first waits for a
        commit that is near (verifier/forecast.py). A save starting also changes checkpoints/ (its tmp
        directory): that must not skip the wait, or the final save's commit lands inside a replay step."""
        if self._forecast is not None:
            self._forecast.keep_free(self._stop)
        return self._workdir_changed()

    def _workdir_changed(self) -> bool:
        """Process 0: whether a listing may find something new (no watch, or gs://: always)."""
        return self._watch is None or not self._watch.watching or self._watch.changed()

    def _write(self, verdict: dict) -> None:
        if not self.ledger.write(verdict, primary=jax.process_index() == 0):  # process 0 writes; refusals logged
            return
        logging.vlog(1, "wrote the %s verdict of step %d (%s)", "complete" if verdict["complete"] else "first",
                     verdict["step"], verdict["level"])
        if verdict["complete"]:
            logging.log(logging.ERROR if verdict["status"] == "fail" else logging.INFO,
                        "verdict step %d: %s %s: %s", verdict["step"], verdict["level"], verdict["status"],
                        verdict["detail"])

    def follow(self, stop: threading.Event, until_step: int | None = None) -> list[dict]:
        """Verifies steps as they commit until `until_step` (or the run's final step) is verified.

        While idle, process 0 waits for a change in the workdir (verifier/commit_watch.py) or the
        backoff delay, whichever comes first; the other processes wait for its word in the
        collective at the top of the loop, so every process lists again (and stops) together.
        """
        written, delay = [], self.options.poll_secs
        self._stop = stop
        self._intact_between_chunks = True
        # Its first look comes before the first listing: a change after either is seen.
        self._watch = CommitWatch(self.options.workdir) if jax.process_index() == 0 else None
        self._forecast = CommitForecast(self.options.workdir, self._watch) if self._watch is not None else None
        while not collective.decided_by_primary(stop.is_set):
            # A few steps per pass, then a fresh listing: a new commit waits for at most their proofs.
            fresh = self.verify_pending(max_steps=HELD_STATES)
            written += fresh
            if self._finished(until_step):
                break
            if fresh:  # more may be pending already: list again at once, and back off from the start
                delay = self.options.poll_secs
                continue
            if self._watch is not None:
                self._watch.wait(delay, stop)
            delay = min(delay * 2, self.options.max_poll_secs)
        if stop.is_set():  # stopped while idle: steps held for a probe still to come are not replaying either
            self._mark_interrupted(self._planned | set(self._held) | self._intact_only)
        return written

    def _agreed_plan(self) -> list[tuple[int, int | None]]:
        """(step, newest reproduced step on disk before it) pairs, decided by process 0 for all.

        Processes listing the directory themselves could see different steps (a commit lands
        between two listings) and then replay different lengths: a deadlock in the collectives.
        """
        plan = []
        if jax.process_index() == 0:
            pending, proved = self._pending_and_proved()
            for step in pending:
                plan.append((step, next((s for s in reversed(proved) if s < step), None)))
        rows = collective.broadcast_rows([(step, -1 if anchor is None else anchor) for step, anchor in plan], 2)
        return [(step, None if anchor == -1 else anchor) for step, anchor in rows]

    def _finished(self, until_step: int | None) -> bool:
        return collective.decided_by_primary(lambda: self._finished_here(until_step))

    def _finished_here(self, until_step: int | None) -> bool:
        if self.pending_steps():
            return False
        committed = committed_steps(self.options.workdir)
        if not committed:
            return False
        last = committed[-1]
        if until_step is not None:
            return last >= until_step
        try:
            return read_manifest(self.options.workdir, last)["reason"] == "final"
        except CheckpointError:  # its failed verdict is written; the run may still commit more: keep following
            return False
