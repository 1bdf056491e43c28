"""Under --follow, a commit made between two replays (during a probe's marked step) gets its first verdict
before the next replay's first step, not after it; and the forecast judges the next replayed step by the
longest of the last few, so that it does not start one that would end inside a commit's window."""

import os
import threading
import time

import pytest

from checkpointing._src import verdicts
from tests import helpers
from tests.tamper import RUN
from tests.verifier_recording import RecordingVerifier
from verifier import forecast as forecast_module
from verifier import program as program_lib
from verifier import verifier as verifier_module
from verifier.commit_watch import CommitWatch
from verifier.forecast import CommitForecast
from verifier.verifier import VerifierOptions

pytestmark = pytest.mark.slow


@pytest.fixture
def trained(trained_copy, workdir):
    """This test's own copy of tamper.RUN (steps 10, 20, 30, each with its probe), in `workdir`; its probes'
    summaries come from the trainer's step (--probe_summaries=device), so the cheap proof replays a marked
    step (on CPU they are taken on the host by default: no marked step)."""
    return trained_copy(workdir, **RUN, probe_summaries="device")


class EventsVerifier(RecordingVerifier):
    """Records the verdict writes as ("intact" | "complete", step) beside the events the test adds."""

    def __init__(self, options):
        super().__init__(options)
        self.events = []

    def _write(self, verdict):
        super()._write(verdict)
        self.events.append(("complete" if verdict["complete"] else "intact", verdict["step"]))


def test_a_commit_made_during_a_probes_marked_step_is_proved_before_the_next_replayed_step(
        workdir, trained, monkeypatch):
    # Step 30's save commits during the marked step of step 10's cheap proof (the last step of its window,
    # replayed outside the chunks). The full proof of step 10 replays next: step 30's intact proof must
    # come before that replay's first step ends.
    committed = helpers.checkpoint_dir(workdir, "30")
    in_flight = helpers.checkpoint_dir(workdir, "30.orbax-checkpoint-tmp-1700000000")
    os.rename(committed, in_flight)
    verifier = EventsVerifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),)))
    real_marked, real_replay = program_lib.replay_marked_step, verifier_module.program_lib.replay_losses

    def marked_step(program, state, step, batches=None):
        out = real_marked(program, state, step, batches)
        verifier.events.append(("marked", step))
        if os.path.exists(in_flight):
            os.rename(in_flight, committed)
            verifier.events.append(("committed", 30))
        return out

    def replay_losses(program, state, first, steps, batches=None, perturb=None):
        out = real_replay(program, state, first, steps, batches, perturb)
        verifier.events.append(("chunk", first))
        return out

    monkeypatch.setattr(program_lib, "replay_marked_step", marked_step)
    monkeypatch.setattr(verifier_module.program_lib, "replay_losses", replay_losses)
    stop = threading.Event()
    deadline = threading.Timer(300, stop.set)  # a follow that never sees step 30 fails below instead of hanging
    deadline.start()
    try:
        verifier.follow(stop, until_step=30)
    finally:
        deadline.cancel()
    events = verifier.events
    assert ("committed", 30) in events, f"no marked step ran: step 10 has no probe? {events}"
    commit, first_verdict = events.index(("committed", 30)), events.index(("intact", 30))
    assert commit < first_verdict, events
    assert [e for e in events[commit:first_verdict] if e[0] in ("chunk", "marked")] == [], events
    # It was made between two replays of step 10: its full proof (from step 0) replays after it.
    assert ("chunk", 0) in events[first_verdict:] and ("complete", 10) in events[first_verdict:], events
    assert [verdicts.read_all(workdir)[step]["level"] for step in (10, 20, 30)] == ["reproduced"] * 3


def test_the_forecast_waits_when_the_slowest_recent_replayed_step_would_end_inside_the_window(
        workdir, trained, monkeypatch):
    # The last chunk took 1.4 s a step, the one before 1.7 s (a replay's first step is the slowest); the next
    # commit's window opens in 1.5 s. Judged by the last chunk alone, a step would end before the window
    # opens and the verifier would start one; judged by the slowest, it waits, and the commit (0.5 s from
    # now) lands during the wait.
    committed = helpers.checkpoint_dir(workdir, "30")
    outside = os.path.join(workdir, "step-30-not-started")
    os.rename(committed, outside)
    monkeypatch.setattr(forecast_module, "next_commit_window",
                        lambda times, step_secs: (time.time() + 1.5, time.time() + 8.0))
    forecast = CommitForecast(workdir, CommitWatch(workdir))
    forecast.replayed(secs=17.0, steps=10)
    forecast.replayed(secs=14.0, steps=10)  # allowance 6.2 s, far beyond the wait
    commit = threading.Timer(0.5, os.rename, (outside, committed))
    commit.start()
    try:
        forecast.keep_free(threading.Event())
        assert os.path.isdir(committed), "keep_free came back before the forecast commit: it did not wait"
    finally:
        commit.join(timeout=10)
