"""The commit watch (verifier/commit_watch.py) on real directories: a rename into checkpoints/ or
probes/ ends the wait at once; with no change the wait lasts until its timeout (the backoff). A
commit's time is its directory's rename, the next is forecast from the last intervals, and a wait for a
commit ends at it or at its timeout."""

import os
import threading
import time

import pytest

from verifier import commit_watch
from verifier.commit_watch import CommitWatch

LONG_BACKOFF_SECS = 30.0  # far longer than any wait a test expects
HANG_GUARD_SECS = 10.0  # only a guard against a wait that never returns, not a speed requirement


def settled(*paths):
    """Dates `paths` a minute back, so their signatures are not racy (commit_watch.RACY_SECS)."""
    past = time.time() - 60
    for path in paths:
        os.utime(path, (past, past))


@pytest.fixture
def checkpoints(tmp_path):
    path = tmp_path / "checkpoints"
    path.mkdir()
    settled(path)
    return path


def wait_in_thread(watch, timeout_secs):
    """Starts watch.wait in a thread; returns (thread, result dict) once it is waiting."""
    result, stop = {}, threading.Event()

    def run():
        started = time.monotonic()
        result["changed"] = watch.wait(timeout_secs, stop)
        result["secs"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.1)  # several ticks: the watch is past its first look
    return thread, result, stop


def test_a_commit_rename_ends_the_wait(tmp_path, checkpoints):
    tmp = checkpoints / "8.orbax-checkpoint-tmp-1700000000"
    tmp.mkdir()
    settled(tmp, checkpoints)
    watch = CommitWatch(str(tmp_path))
    assert watch.watching
    thread, result, _ = wait_in_thread(watch, LONG_BACKOFF_SECS)
    assert thread.is_alive(), "nothing changed yet: the wait goes on"
    tmp.rename(checkpoints / "8")  # what an Orbax commit does on a local disk
    thread.join(HANG_GUARD_SECS)
    assert not thread.is_alive() and result["changed"] is True
    assert result["secs"] < LONG_BACKOFF_SECS  # woken by the rename, not by the backoff


def test_a_probe_landing_ends_the_wait(tmp_path, checkpoints):
    probes = tmp_path / "probes"
    probes.mkdir()
    settled(probes)
    watch = CommitWatch(str(tmp_path))
    thread, result, _ = wait_in_thread(watch, LONG_BACKOFF_SECS)
    written = probes / "8.json.tmp"
    written.write_text("{}")
    written.rename(probes / "8.json")
    thread.join(HANG_GUARD_SECS)
    assert not thread.is_alive() and result["changed"] is True


def test_the_checkpoints_directory_appearing_ends_the_wait(tmp_path):
    # The verifier may start before the trainer has created anything.
    watch = CommitWatch(str(tmp_path))
    thread, result, _ = wait_in_thread(watch, LONG_BACKOFF_SECS)
    (tmp_path / "checkpoints").mkdir()
    thread.join(HANG_GUARD_SECS)
    assert not thread.is_alive() and result["changed"] is True


def test_with_no_change_the_wait_lasts_until_its_timeout(tmp_path, checkpoints):
    watch = CommitWatch(str(tmp_path))
    started = time.monotonic()
    assert watch.wait(0.3, threading.Event()) is False
    assert time.monotonic() - started >= 0.3


def test_a_wait_after_a_change_was_seen_waits_for_the_next_one(tmp_path, checkpoints, monkeypatch):
    monkeypatch.setattr(commit_watch, "_RACY_NS", 0)  # the rename's fresh mtime is not racy here
    watch = CommitWatch(str(tmp_path))
    (checkpoints / "8").mkdir()
    assert watch.wait(LONG_BACKOFF_SECS, threading.Event()) is True
    assert watch.wait(0.2, threading.Event()) is False


def test_a_racy_signature_is_looked_at_once_more(tmp_path, checkpoints, monkeypatch):
    # A change within the filesystem's timestamp granularity of the look could leave the same mtime:
    # a look that soon after the change wakes the verifier once more, RACY_SECS later.
    monkeypatch.setattr(commit_watch, "_RACY_NS", int(0.3e9))
    (checkpoints / "8").mkdir()  # mtime now: the first look is racy
    watch = CommitWatch(str(tmp_path))
    assert watch.wait(LONG_BACKOFF_SECS, threading.Event()) is True
    assert watch.wait(0.5, threading.Event()) is False  # settled: no more wake-ups without a change


def test_stop_ends_the_wait(tmp_path, checkpoints):
    watch = CommitWatch(str(tmp_path))
    thread, result, stop = wait_in_thread(watch, LONG_BACKOFF_SECS)
    stop.set()
    thread.join(HANG_GUARD_SECS)
    assert not thread.is_alive() and result["changed"] is False


def commit_later(tmp, committed, delay_secs=0.3):
    """Renames `tmp` to `committed` after `delay_secs`, from a thread; returns (thread, {"at": its time})."""
    renamed = {}

    def commit():
        time.sleep(delay_secs)
        renamed["at"] = time.monotonic()
        tmp.rename(committed)

    thread = threading.Thread(target=commit, daemon=True)
    thread.start()
    return thread, renamed


def test_a_wait_for_a_due_commit_ends_when_a_newer_step_commits(tmp_path, checkpoints):
    # Only a step above the newest ends the wait (a save's tmp directory does not).
    (checkpoints / "8").mkdir()
    watch = CommitWatch(str(tmp_path))
    tmp = tmp_path / "elsewhere.tmp"  # written outside checkpoints/, renamed in: only the commit shows
    tmp.mkdir()
    thread, renamed = commit_later(tmp, checkpoints / "16")
    watch.wait_for_commit(8, LONG_BACKOFF_SECS, threading.Event())
    returned = time.monotonic()
    thread.join(HANG_GUARD_SECS)
    assert "at" in renamed and renamed["at"] <= returned, "it returned before the commit"
    assert returned - renamed["at"] < LONG_BACKOFF_SECS


def test_a_wait_for_a_commit_that_never_comes_lasts_until_its_timeout(tmp_path, checkpoints):
    (checkpoints / "8").mkdir()
    (checkpoints / "16.orbax-checkpoint-tmp").mkdir()  # a killed save's directory is no commit
    watch = CommitWatch(str(tmp_path))
    started = time.monotonic()
    watch.wait_for_commit(8, 0.3, threading.Event())
    assert time.monotonic() - started >= 0.3


def test_a_commits_time_is_its_directorys_rename(tmp_path, checkpoints):
    watch = CommitWatch(str(tmp_path))
    before = time.time()
    for step in (8, 16):
        (tmp_path / f"{step}.tmp").mkdir()
        (tmp_path / f"{step}.tmp").rename(checkpoints / str(step))
    (checkpoints / "24.orbax-checkpoint-tmp").mkdir()  # in progress: not a commit
    times = watch.commit_times()
    assert set(times) == {8, 16} and all(before - 1 <= t <= time.time() + 1 for t in times.values()), times


def test_only_the_newest_commits_are_timed_in_step_order(tmp_path, checkpoints):
    watch = CommitWatch(str(tmp_path))
    for step in (8, 16, 24, 32, 40, 48, 100):  # "100" sorts before "16" by name
        (checkpoints / str(step)).mkdir()
    assert sorted(watch.commit_times()) == [24, 32, 40, 48, 100]  # WINDOW_INTERVALS + 1 of them
    assert sorted(watch.commit_times(newest=2)) == [48, 100]


def test_the_saves_being_written_are_orbaxs_tmp_directories(tmp_path, checkpoints):
    watch = CommitWatch(str(tmp_path))
    assert watch.in_flight_steps() == set()
    for name in ("8", "16.orbax-checkpoint-tmp-1700000000", "80.orbax-checkpoint-tmp-1700000001", "notes"):
        (checkpoints / name).mkdir()
    assert watch.in_flight_steps() == {16, 80}
    os.rename(checkpoints / "80.orbax-checkpoint-tmp-1700000001", checkpoints / "80")  # committed
    assert watch.in_flight_steps() == {16}
    assert CommitWatch("gs://bucket/run").in_flight_steps() == set()


def test_the_next_commit_is_forecast_from_the_spread_of_the_last_intervals():
    window = commit_watch.next_commit_window
    # Intervals 11 and 10 after the commit at 121: the shortest to the longest, and half a step more.
    assert window({8: 100.0, 16: 111.0, 24: 121.0}, step_secs=0.8) == (131.0, 132.4)
    assert window({24: 121.0, 8: 100.0, 16: 111.0}, step_secs=0.8) == (131.0, 132.4)  # by step, not by order
    # Only the last WINDOW_INTERVALS intervals count: an old, long one (a restart's) is forgotten.
    old_then_steady = {0: 0.0, 8: 100.0, 16: 110.0, 24: 120.0, 32: 130.0, 40: 140.0}
    assert commit_watch.WINDOW_INTERVALS == 4 and window(old_then_steady, step_secs=0.0) == (150.0, 150.0)
    assert window({8: 100.0}, step_secs=0.8) is None and window({}, step_secs=0.8) is None


def test_a_gcs_workdir_is_not_watched_and_waits_out_the_backoff():
    watch = CommitWatch("gs://bucket/run")
    assert not watch.watching
    assert watch.commit_times() == {}
    started = time.monotonic()
    assert watch.wait(0.2, threading.Event()) is False
    assert time.monotonic() - started >= 0.2
