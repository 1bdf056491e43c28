"""The verifier under --follow: new commits are proved intact while it replays older ones, and a commit
wakes it at once (the first verdict waits for no whole replay)."""

import os
import threading
import time

import pytest

from checkpointing import verdicts
from tests import helpers
from tests.tamper import RUN
from tests.verifier_recording import RecordingVerifier
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
