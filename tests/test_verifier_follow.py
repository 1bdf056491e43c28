"""The verifier under --follow: new commits are proved intact while it replays older ones, and a commit
wakes it at once (the first verdict waits for no whole replay)."""

import os
import threading
import time

import pytest

from checkpointing._src import verdicts
from checkpointing._src.workdir import read_manifest
from tests import helpers
from tests.tamper import RUN
from tests.verifier_recording import RecordingVerifier
from verifier import forecast as forecast_module
from verifier.commit_watch import CommitWatch
from verifier.forecast import CommitForecast
from verifier import verifier as verifier_module
from verifier.verifier import HELD_STATES, REPLAY_CHUNK_STEPS, Verifier, VerifierOptions

pytestmark = pytest.mark.slow


@pytest.fixture
def trained(trained_copy, workdir):
    """This test's own copy of tamper.RUN (steps 10, 20, 30), in `workdir`: its config."""
    return trained_copy(workdir, **RUN)


def test_follow_proves_new_commits_intact_during_a_replay(workdir, trained, restored_steps):
    # Under --follow, steps found between replay chunks are proved intact at once (up to
    # HELD_STATES held): step 30's first verdict does not wait for step 10's 10-step replay.
    assert HELD_STATES == 2 and REPLAY_CHUNK_STEPS < 10
    verifier = RecordingVerifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier.follow(threading.Event(), until_step=30)
    assert verifier.writes == [(10, False), (20, False), (30, False), (10, True), (20, True), (30, True)]
    assert restored_steps == [10, 20, 30]
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


def test_follow_wakes_on_a_commit_not_on_its_backoff(workdir, trained):
    # A backoff far longer than the test: only the commit watch (verifier/commit_watch.py) can start
    # step 30's proof once its save is renamed into place, as an Orbax commit does on a local disk.
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    os.rename(committed, in_flight)
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),), follow=True, poll_secs=3600,
                                        max_poll_secs=3600))
    stop, written = threading.Event(), []
    thread = threading.Thread(target=lambda: written.extend(verifier.follow(stop, until_step=30)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300  # hang guards, not speed requirements
        while not (verdicts.read(workdir, 20) or {}).get("complete") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive(), "follow returned before step 30 was committed"
        time.sleep(0.5)  # it is idle now, waiting on the watch
        os.rename(in_flight, committed)
        thread.join(300)
        assert not thread.is_alive(), "the commit of step 30 did not wake the verifier"
    finally:
        stop.set()
    assert [(v["step"], v["level"], v["status"]) for v in written] == [(s, "reproduced", "pass") for s in (10, 20, 30)]


class CommitDuringReplay(RecordingVerifier):
    """Renames a hidden save into place at the second look for new commits of a replay (its first chunk is
    over), and counts the listings (the plans agreed)."""

    def __init__(self, options, hidden, committed):
        super().__init__(options)
        self.moves, self.looks, self.listings = (hidden, committed), 0, 0

    def _prove_new_commits_intact(self, first_chunk):
        self.looks += 1
        if self.looks == 2:
            os.rename(*self.moves)
        super()._prove_new_commits_intact(first_chunk)

    def _agreed_plan(self):
        self.listings += 1
        return super()._agreed_plan()


def follow_with_step_30_committed_mid_replay(workdir) -> CommitDuringReplay:
    """--follow over the trained run with step 30 hidden until the second look of the first replay."""
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    os.rename(committed, in_flight)
    verifier = CommitDuringReplay(VerifierOptions(workdir=workdir, mesh=(("data", 8),)), in_flight, committed)
    verifier.follow(threading.Event(), until_step=30)
    return verifier


def test_follow_proves_a_commit_made_mid_replay_at_the_next_step_and_lists_only_after_a_change(workdir, trained):
    # On a local workdir --follow looks for new commits after every replayed step, but after a replay's
    # first chunk it lists only when the commit watch saw a change.
    verifier = follow_with_step_30_committed_mid_replay(workdir)
    assert verifier.writes == [(10, False), (20, False), (30, False), (10, True), (20, True), (30, True)]
    # A look after every replayed step (3 full proofs of 10 steps, 3 cheap ones of a few), and listings
    # only at each pass, each replay's first look and the looks after a change.
    assert verifier.looks >= 27 and verifier.listings < verifier.looks // 2, (verifier.looks, verifier.listings)


def test_a_commit_made_while_every_held_state_waits_is_proved_intact_at_once_and_restored_again(
        workdir, trained, restored_steps, monkeypatch):
    # One state held (HELD_STATES=1 here): step 20 waits, held, behind step 10's replay when step 30
    # commits. Its intact verdict comes before step 10's complete one, not after step 20's replay.
    monkeypatch.setattr(verifier_module, "HELD_STATES", 1)
    verifier = follow_with_step_30_committed_mid_replay(workdir)
    assert verifier.writes == [(10, False), (20, False), (30, False), (10, True), (20, True), (30, True)]
    assert restored_steps == [10, 20, 30, 30]  # its state was let go: its own replay restored it again
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


class OneChunkCommitAtFirstLook(RecordingVerifier):
    """Every replay one chunk; a hidden save renamed into place at the first look for new commits (or, so that
    a verifier that never looks still finishes, at its first complete verdict)."""

    def __init__(self, options, hidden, committed):
        super().__init__(options)
        self.moves = [(hidden, committed)]

    def _chunk_steps(self):
        return 1000

    def _commit_the_hidden_save(self):
        while self.moves:
            os.rename(*self.moves.pop())

    def _prove_new_commits_intact(self, first_chunk):
        self._commit_the_hidden_save()
        super()._prove_new_commits_intact(first_chunk)

    def _write(self, verdict):
        super()._write(verdict)
        if verdict["complete"]:
            self._commit_the_hidden_save()


def test_a_commit_made_during_a_replays_last_chunk_is_proved_intact_before_that_steps_verdict(workdir, trained):
    # What follows a replay's last chunk (a probe's marked step, the full proof, the state's comparison) is
    # still a wait for a commit made meanwhile: --follow looks after the last chunk too.
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    os.rename(committed, in_flight)
    verifier = OneChunkCommitAtFirstLook(VerifierOptions(workdir=workdir, mesh=(("data", 8),)), in_flight, committed)
    verifier.follow(threading.Event(), until_step=30)
    assert verifier.writes == [(10, False), (20, False), (30, False), (10, True), (20, True), (30, True)]
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3



class CommitDueDuringFirstChunk(RecordingVerifier):
    """Records replay chunks as ("chunk", first step) when they end, the commit of a hidden save (renamed
    into place COMMIT_DELAY_SECS after the first chunk ends, from a thread: a write in progress) and
    the verdict writes."""

    COMMIT_DELAY_SECS = 0.2

    def __init__(self, options, hidden, committed, save_starts=None):
        super().__init__(options)
        self.moves, self.events, self.committer = (hidden, committed), [], None
        self.save_starts = save_starts  # (outside checkpoints/, the tmp directory): moved in as the chunk ends

    def chunk_ended(self, first_step):
        self.events.append(("chunk", first_step))
        if self.committer is None:
            if self.save_starts:  # the save's tmp directory appears: checkpoints/ changes before the commit
                os.rename(*self.save_starts)
            self.committer = threading.Thread(target=self._commit_later, daemon=True)
            self.committer.start()

    def _commit_later(self):
        time.sleep(self.COMMIT_DELAY_SECS)
        os.rename(*self.moves)
        self.events.append(("committed", 30))

    def _write(self, verdict):
        super()._write(verdict)
        self.events.append(("complete" if verdict["complete"] else "intact", verdict["step"]))


def replaying_through(monkeypatch, on_chunk):
    """Wraps the real replay_losses: `on_chunk(first step, secs)` after each chunk."""
    real_replay = verifier_module.program_lib.replay_losses

    def replay_losses(program, state, first, steps, batches=None, perturb=None):
        began = time.monotonic()
        replayed = real_replay(program, state, first, steps, batches, perturb)
        on_chunk(first, time.monotonic() - began)
        return replayed

    monkeypatch.setattr(verifier_module.program_lib, "replay_losses", replay_losses)


def forecast_due_until(monkeypatch, last_step, open_secs=600.0):
    """A forecast that says the next commit is due now (its window open for `open_secs` more) until
    `last_step` is committed, and then that none is."""

    def window(times, step_secs):
        return None if last_step in times else (time.time() - 1.0, time.time() + open_secs)

    monkeypatch.setattr(forecast_module, "next_commit_window", window)


def assert_step_30_committed_during_step_10s_replay_is_proved_intact_before_its_next_replayed_step(
        workdir, monkeypatch, save_starts_then=False):
    """Step 30's save is in flight until step 10's first replayed step ends (`save_starts_then`: it starts
    there), then commits: no replayed step may end between its commit and its first verdict, and step 10's
    replay is not over by then."""
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    outside = os.path.join(workdir, "step-30-not-started")
    os.rename(committed, outside if save_starts_then else in_flight)
    verifier = CommitDueDuringFirstChunk(VerifierOptions(workdir=workdir, mesh=(("data", 8),)), in_flight,
                                         committed, save_starts=(outside, in_flight) if save_starts_then else None)
    replaying_through(monkeypatch, lambda first, secs: verifier.chunk_ended(first))
    verifier.follow(threading.Event(), until_step=30)
    events = verifier.events
    commit, first_verdict = events.index(("committed", 30)), events.index(("intact", 30))
    assert commit < first_verdict, events
    assert [e for e in events[commit:first_verdict] if e[0] == "chunk"] == [], events
    assert ("chunk", 9) in events[first_verdict:], f"step 10's replay was over before the commit: {events}"
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


def test_a_replay_waits_for_a_forecast_commit_so_its_intact_verdict_comes_before_the_next_replayed_step(
        workdir, trained, monkeypatch):
    # Step 30 is due (the forecast, staged here; its own test is in tests/test_commit_watch.py) and commits
    # during step 10's replay. Between replayed steps the verifier waits for it (here with allowance to
    # spare), so step 30's intact proof runs as soon as it commits, before step 10's replay goes on: no
    # replayed step ends between the commit and step 30's first verdict, and step 10's replay is not over.
    monkeypatch.setattr(forecast_module, "PAUSE_SHARE", 1000.0)
    forecast_due_until(monkeypatch, last_step=30)
    assert_step_30_committed_during_step_10s_replay_is_proved_intact_before_its_next_replayed_step(workdir, monkeypatch)


def test_a_forecast_commit_that_never_comes_costs_a_replay_at_most_its_pause_share(workdir, trained, monkeypatch):
    # A commit forecast that does not come (the trainer died, or changed its cadence): the verifier waits
    # for it between replayed steps, but in all no longer than PAUSE_SHARE of its replay time.
    forecast_due_until(monkeypatch, last_step=40)
    # The run stopped at 20 (30 not committed; had it been, the run's final save would end the forecast).
    os.rename(helpers.checkpoint_dir(workdir, "30"), helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1"))
    waited, replayed = [], []
    real_wait = verifier_module.CommitWatch.wait_for_commit

    def wait_for_commit(self, *args):
        began = time.monotonic()
        real_wait(self, *args)
        waited.append(time.monotonic() - began)

    monkeypatch.setattr(verifier_module.CommitWatch, "wait_for_commit", wait_for_commit)
    replaying_through(monkeypatch, lambda first, secs: replayed.append(secs))
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier.follow(threading.Event(), until_step=20)
    assert waited, "the verifier never waited for the forecast commit"
    # One wait may overrun the allowance by a scheduler's wake-up: the slack, not a speed requirement.
    assert sum(waited) <= forecast_module.PAUSE_SHARE * sum(replayed) + 0.5, (sum(waited), sum(replayed))
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20)] == ["reproduced"] * 2


def test_no_commit_is_forecast_once_the_runs_final_save_is_committed(workdir, trained, monkeypatch):
    # The forecast says a commit is due throughout, but step 30 is the run's final save and is committed
    # from the start: nothing can follow it, so the replays of 10, 20 and 30 never wait (the verifier
    # benchmark's final verdicts waited 7 s for a commit after the last).
    assert read_manifest(workdir, 30)["reason"] == "final"
    forecast_due_until(monkeypatch, last_step=40)
    waited = []
    monkeypatch.setattr(verifier_module.CommitWatch, "wait_for_commit", lambda self, *args: waited.append(args))
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier.follow(threading.Event(), until_step=30)
    assert waited == []
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


def test_without_a_forecast_window_a_replay_never_waits(workdir, trained, monkeypatch):
    # The trained copy's commits all carry the copy's time: no interval, so no window opens, and the
    # verifier replays without waiting (the other follow tests rely on this too).
    waited = []
    monkeypatch.setattr(verifier_module.CommitWatch, "wait_for_commit", lambda self, *args: waited.append(args))
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier.follow(threading.Event(), until_step=30)
    assert waited == []
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


def test_the_runs_final_save_being_written_is_waited_for_though_no_forecast_says_it_is_due(
        workdir, trained, monkeypatch):
    # The final save commits sooner than the cadence says (no training competes with its write), so no
    # forecast is due here; but step 30 is the run's last (its manifests' total_steps) and its save is being
    # written, so between replayed steps the verifier waits for it: its intact proof runs once it commits,
    # before step 10's replay goes on. The save starts during that replay: its tmp directory changing
    # checkpoints/ is no commit to list first (the benchmark's final commits came inside replay steps so).
    assert {read_manifest(workdir, step).get("total_steps") for step in (10, 20, 30)} == {30}
    monkeypatch.setattr(forecast_module, "PAUSE_SHARE", 1000.0)
    monkeypatch.setattr(forecast_module, "next_commit_window", lambda times, step_secs: None)
    assert_step_30_committed_during_step_10s_replay_is_proved_intact_before_its_next_replayed_step(
        workdir, monkeypatch, save_starts_then=True)


def test_a_save_starting_does_not_skip_the_wait_for_the_runs_final_save(workdir, trained):
    # The final save's tmp directory appearing changes checkpoints/, like a commit. Taken for one, it
    # skipped the wait: the verifier listed (nothing new), started a replay step, and the commit landed
    # inside it (the benchmark's final first verdicts, 0.8-2.1 s). Between replayed steps, process 0's look
    # must come back only once step 30 is committed.
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    outside = os.path.join(workdir, "step-30-not-started")
    os.rename(committed, outside)
    verifier = Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    verifier._watch = CommitWatch(workdir)  # what follow() sets up on process 0
    verifier._forecast = CommitForecast(workdir, verifier._watch)
    verifier._forecast.replayed(secs=30.0, steps=1)  # an allowance far beyond the wait
    os.rename(outside, in_flight)  # the final save starts
    commit = threading.Timer(0.5, os.rename, (in_flight, committed))
    commit.start()
    try:
        assert verifier._changed_or_commit_awaited()
        assert os.path.isdir(committed), "the look came back before the final save committed"
    finally:
        commit.join(timeout=10)
