"""The save being written tells when it commits (verifier/write_progress.py), on real directories: its bytes
against the newest checkpoint's and their rate give how soon it commits; without a rate, no commit comes
sooner after its save is seen than the shortest write timed so far. Between replayed steps the verifier
waits for a save about to commit, and not for one far from it, whatever the cadence says
(verifier/forecast.py)."""

import os
import threading
import time

import pytest

from verifier import forecast as forecast_module
from verifier import write_progress
from verifier.commit_watch import CommitWatch
from verifier.forecast import CommitForecast
from verifier.write_progress import WriteProgress

HANG_GUARD_SECS = 10.0  # only a guard against a wait that never returns, not a speed requirement


@pytest.fixture
def checkpoints(tmp_path):
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


def write(path, size):
    """A save's data file of `size` bytes (Orbax's array file grows as it is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def committed(checkpoints, step, size):
    write(checkpoints / str(step) / "state" / "data", size - 100)
    write(checkpoints / str(step) / "manifest" / "metadata", 100)


def in_flight(checkpoints, step, size):
    write(checkpoints / f"{step}.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp" / "data", size)


def test_a_directorys_bytes_are_its_files_sizes_summed(tmp_path):
    write(tmp_path / "a" / "one", 300)
    write(tmp_path / "a" / "b" / "two", 700)
    assert write_progress.directory_bytes(str(tmp_path / "a")) == 1000
    assert write_progress.directory_bytes(str(tmp_path / "a"), max_files=1) is None  # too many to stat
    assert write_progress.directory_bytes(str(tmp_path / "gone")) is None


def test_a_save_commits_when_the_rest_of_its_bytes_are_written_at_their_rate(tmp_path, checkpoints):
    committed(checkpoints, 10, 1000)
    progress = WriteProgress(CommitWatch(str(tmp_path)), started_at=0.0)
    in_flight(checkpoints, 20, 200)
    progress.look({10: -100.0}, now=100.0)
    assert progress.estimate(10, now=100.0) is None  # one look: no rate, no write timed yet
    in_flight(checkpoints, 20, 700)
    progress.look({10: -100.0}, now=101.0)
    estimate = progress.estimate(10, now=101.0)
    assert estimate.exact and estimate.secs == pytest.approx((1000 - 700) / 500), estimate
    in_flight(checkpoints, 20, 990)  # 99%: its last small files and the rename are left
    progress.look({10: -100.0}, now=101.2)
    assert progress.estimate(10, now=101.2) == write_progress.Estimate(0.0, True, "step 20's save 99% written")


def test_a_rate_is_measured_over_at_least_rate_secs(tmp_path, checkpoints):
    committed(checkpoints, 10, 1000)
    progress = WriteProgress(CommitWatch(str(tmp_path)), started_at=0.0)
    for now, size in ((100.0, 200), (100.1, 300), (100.2, 400)):  # looks ms apart: a rate would be noise
        in_flight(checkpoints, 20, size)
        progress.look({10: -100.0}, now=now)
    assert write_progress.RATE_SECS > 0.2 and progress.estimate(10, now=100.2) is None
    in_flight(checkpoints, 20, 600)
    progress.look({10: -100.0}, now=100.1 + write_progress.RATE_SECS)
    # From the newest look at least RATE_SECS back (100.1, 300 bytes): 300 bytes in RATE_SECS.
    estimate = progress.estimate(10, now=100.1 + write_progress.RATE_SECS)
    assert estimate.exact and estimate.secs == pytest.approx(400 / (300 / write_progress.RATE_SECS))


def test_without_a_rate_no_commit_is_sooner_than_the_shortest_timed_write(tmp_path, checkpoints):
    progress = WriteProgress(CommitWatch(str(tmp_path)), started_at=50.0)
    commits = {}
    for step, seen, commit in ((10, 100.0, 106.0), (20, 110.0, 115.0)):  # writes seen for 6 and 5 s
        in_flight(checkpoints, step, 500)
        progress.look(commits, now=seen)
        os.rename(checkpoints / f"{step}.orbax-checkpoint-tmp", checkpoints / str(step))
        commits[step] = commit
        progress.look(commits, now=commit)
    # No save in flight: the next commit is at least the shortest write away.
    assert progress.estimate(20, now=116.0) == write_progress.Estimate(
        5.0, False, "no save commits sooner than 5.00s after it is seen")
    in_flight(checkpoints, 30, 10)  # seen now, no rate yet: the bound counts from its first sight
    progress.look(commits, now=118.0)
    assert progress.estimate(20, now=119.5).secs == pytest.approx(3.5)


def test_a_write_shorter_than_a_look_apart_leaves_no_bound(tmp_path, checkpoints):
    # Step 20 committed without its save ever being seen: a write can be shorter than the time between two
    # looks, so no commit is bounded away; and commits from before the verifier started are not timed.
    progress = WriteProgress(CommitWatch(str(tmp_path)), started_at=50.0)
    in_flight(checkpoints, 10, 500)
    progress.look({0: 10.0}, now=100.0)
    os.rename(checkpoints / "10.orbax-checkpoint-tmp", checkpoints / "10")
    progress.look({0: 10.0, 10: 106.0}, now=106.0)
    progress.look({0: 10.0, 10: 106.0, 20: 112.0}, now=112.0)
    assert progress.estimate(20, now=113.0) is None


def forecast_with(tmp_path, step_secs):
    watch = CommitWatch(str(tmp_path))
    forecast = CommitForecast(str(tmp_path), watch)
    forecast.replayed(secs=step_secs, steps=1)
    return forecast


def test_a_replay_waits_for_a_save_about_to_commit_and_not_for_one_far_from_it(tmp_path, checkpoints, monkeypatch):
    committed(checkpoints, 10, 100_000)
    monkeypatch.setattr(forecast_module, "PAUSE_SHARE", 1000.0)  # an allowance far beyond any wait here
    due = []  # once set, the cadence says a commit is due: the save's own progress decides
    monkeypatch.setattr(forecast_module, "next_commit_window",
                        lambda times, step_secs: (0.0, time.time() + 5.0) if due else None)
    forecast = forecast_with(tmp_path, step_secs=1.0)
    waited = []
    real_wait = CommitWatch.wait_for_commit
    monkeypatch.setattr(CommitWatch, "wait_for_commit",
                        lambda self, *args: waited.append(args[1]) or real_wait(self, *args))
    in_flight(checkpoints, 20, 1_000)
    forecast.keep_free(threading.Event())  # its first look: no rate yet, and nothing due
    due.append(True)
    time.sleep(write_progress.RATE_SECS)
    in_flight(checkpoints, 20, 2_000)  # about 2 KB/s: the rest takes about 50 s, far beyond a replayed step
    forecast.keep_free(threading.Event())
    assert waited == [], "it waited for a save far from its commit"
    in_flight(checkpoints, 20, 99_000)  # 99%: about to commit
    tmp = checkpoints / "20.orbax-checkpoint-tmp"
    commit = threading.Timer(0.3, os.rename, (tmp, checkpoints / "20"))
    commit.start()
    try:
        forecast.keep_free(threading.Event())
        assert (checkpoints / "20").is_dir(), "the look came back before the save committed"
        assert len(waited) == 1 and waited[0] <= 1.0 + 1e-9, waited  # its estimate (0 s) and a step at most
    finally:
        commit.join(timeout=HANG_GUARD_SECS)
