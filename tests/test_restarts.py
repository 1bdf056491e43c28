"""Restarts: the phase lines, the persistent compilation cache, --save_every_secs=auto and the
preemption deadline, each through the real `python -m trainer.train` (processes ended by PID)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from checkpointing._src.workdir import committed_steps, read_manifest
from checkpointing._src.workdir import step_dir
from tests import helpers

pytestmark = pytest.mark.slow

PHASES = ("process_start", "distributed_start", "open", "compile", "restore", "first_step")
MLP = ("--mesh=data=4,model=2", "--steps=12", "--save_every_steps=6")


def train(workdir, *flags, **env):
    return helpers.run_module("trainer.train", f"--workdir={workdir}", *MLP, *flags, **env)


def cache_files(cache) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(cache, name)) for name in os.listdir(cache)}


def test_phase_lines_and_a_warm_restart_compiles_nothing_new(tmp_path):
    cache = str(tmp_path / "cache")
    first = train(tmp_path / "a", f"--compilation_cache_dir={cache}")
    assert first.returncode == 0, first.stderr[-3000:]
    for name in PHASES:
        assert len(re.findall(rf"phase {name} \d+\.\d+s$", first.stderr, re.M)) == 1, name
    entries = cache_files(cache)
    assert entries, "the first run cached nothing"
    second = train(tmp_path / "b", f"--compilation_cache_dir={cache}")  # the same job, restarted cold
    assert second.returncode == 0, second.stderr[-3000:]
    assert cache_files(cache) == entries  # every executable came from the cache: no new entry


def test_resume_reads_the_cache_and_logs_every_phase(tmp_path):
    cache, workdir = str(tmp_path / "cache"), str(tmp_path / "run")
    assert train(workdir, f"--compilation_cache_dir={cache}").returncode == 0
    entries = cache_files(cache)
    resumed = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=4,model=2", "--steps=18",
                                 "--save_every_steps=6", f"--compilation_cache_dir={cache}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 12" in resumed.stderr
    assert all(f"phase {name} " in resumed.stderr for name in PHASES)
    assert cache_files(cache) == entries  # the resume compiled nothing the first run had not


def test_corrupt_cache_entries_are_one_warning_and_a_compile(tmp_path):
    cache = str(tmp_path / "cache")
    assert train(tmp_path / "a", f"--compilation_cache_dir={cache}").returncode == 0
    corrupted = 0
    for folder, _, names in os.walk(cache):  # JAX's entries and the kept executables (executables/)
        for name in names:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"not an executable" * 7)
            corrupted += 1
    assert corrupted > 1 and os.listdir(os.path.join(cache, "executables")), "nothing was kept to corrupt"
    result = train(tmp_path / "b", f"--compilation_cache_dir={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"compilation cache .*compiling instead", result.stderr)) == 1, result.stderr[-3000:]
    assert len(re.findall(r"executable .* cannot be loaded .*compiling instead", result.stderr)) == 1, \
        result.stderr[-3000:]
    assert committed_steps(str(tmp_path / "b")) == [6, 12]


def test_every_process_of_a_pod_loads_its_executables_from_the_cache_on_a_restart(tmp_path):
    # JAX writes entries from process 0 only, and on CPU each process's keys are its own: without
    # trainer/compile_cache.py's writer, process 1 recompiled everything at every restart while the
    # pod waited for it.
    def pod(steps: int) -> tuple[dict[int, tuple[int, int]], dict[int, str]]:
        result = subprocess.run([sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=1",
                                 "--", f"--workdir={tmp_path / 'run'}", f"--steps={steps}", "--mesh=data=2",
                                 "--save_every_steps=3", f"--compilation_cache_dir={tmp_path / 'cache'}"],
                                env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stdout[-3000:]
        found = re.findall(r"compilation cache: (\d+) of (\d+) lookups hit \(process (\d)\)", result.stdout)
        kept = re.findall(r"save marks' fingerprints: (\w+) \(process (\d)\)", result.stdout)
        return ({int(process): (int(hits), int(lookups)) for hits, lookups, process in found},
                {int(process): source for source, process in kept})

    cold, compiled = pod(3)
    assert set(cold) == {0, 1} and all(hits == 0 < lookups for hits, lookups in cold.values()), cold
    assert compiled == {0: "compiled", 1: "compiled"}
    warm, loaded = pod(6)
    assert set(warm) == {0, 1} and all(hits == lookups > 0 for hits, lookups in warm.values()), warm
    assert loaded == {0: "disk", 1: "disk"}  # each process's own kept executable (checkpointing/_src/executables.py)


def test_cache_dir_that_is_a_file_is_one_warning(tmp_path):
    blocker = tmp_path / "cache-file"
    blocker.write_text("mine")
    result = train(tmp_path / "a", f"--compilation_cache_dir={blocker}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"compilation cache .* is unusable", result.stderr)) == 1
    assert blocker.read_text() == "mine"


def test_save_every_secs_auto_records_its_interval_and_bad_values_exit_2(tmp_path):
    workdir = str(tmp_path / "run")
    result = train(workdir, "--save_every_secs=auto", f"--compilation_cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"save interval \d+\.\ds \(was .*\): save cost C unmeasured, mean time between "
                     r"interruptions M 3600s", result.stderr), result.stderr[-3000:]
    extra = read_manifest(workdir, 12)["extra"]
    assert extra["save_interval_secs"] > 0 and extra["save_cost_secs"] > 0 and extra["interruptions"] == 0
    assert len(extra["commit_secs"]) == 1  # step 6's commit, measured before step 12 saved
    # M counts only interruptions that lost work: extending a finished run is none, a resume from
    # a step that was not saved at a preemption or at the end (a crash) is one.
    cache = f"--compilation_cache_dir={tmp_path / 'cache'}"
    crashed = str(tmp_path / "crashed")
    shutil.copytree(workdir, crashed)
    shutil.rmtree(step_dir(crashed, 12))  # as if the run had died before step 12 committed
    assert train(workdir, "--save_every_secs=auto", "--steps=18", cache).returncode == 0
    assert read_manifest(workdir, 18)["extra"]["interruptions"] == 0
    assert train(crashed, "--save_every_secs=auto", cache).returncode == 0
    assert read_manifest(crashed, 12)["extra"]["interruptions"] == 1
    before = helpers.disk_state(str(tmp_path / "bad"))  # missing, and must stay so
    bad = train(tmp_path / "bad", "--save_every_secs=often")
    assert helpers.assert_refused(bad, before) == \
        "error: --save_every_secs must be a number of seconds or 'auto', got 'often'"


def preempt_after_two_commits(tmp_path, *flags):
    """Trains with saves every 5 steps, SIGTERMs once two steps committed; (returncode, log, workdir)."""
    workdir, log = str(tmp_path / "run"), str(tmp_path / "train.log")
    with helpers.started_module("trainer.train", f"--workdir={workdir}", "--mesh=data=8", "--steps=100000",
                                "--save_every_steps=5", f"--compilation_cache_dir={tmp_path / 'cache'}",
                                *flags, log_path=log) as proc:
        deadline = time.monotonic() + 240
        while len(committed_steps(workdir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        before = committed_steps(workdir)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    with open(log) as f:
        return code, f.read(), workdir, before


def test_sigterm_saves_when_the_commit_fits(tmp_path):
    code, log, workdir, before = preempt_after_two_commits(tmp_path)
    assert code == 75, log[-3000:]
    after = committed_steps(workdir)
    assert after[-1] > before[-1] and read_manifest(workdir, after[-1])["reason"] == "preemption"
    assert "starting no save" not in log and "would not commit in time" not in log


def test_sigterm_starts_no_save_that_cannot_fit_the_grace_period(tmp_path):
    code, log, workdir, before = preempt_after_two_commits(tmp_path, "--preemption_grace_secs=0.0001")
    assert code == 75, log[-3000:]
    assert len(re.findall(r"checkpoint commits take \d+\.\d+s \(p90 of the last \d+\) but "
                          r"--preemption_grace_secs=0.0001", log)) == 1  # warned once
    assert "--signal=TERM@" in log and "terminationGracePeriodSeconds" in log
    assert re.search(r"preemption at step \d+: starting no save: its commit would take about \d+\.\d+s", log)
    after = committed_steps(workdir)
    assert all(read_manifest(workdir, step)["reason"] != "preemption" for step in after)
    assert after and after[-1] >= before[-1]  # the interval saves stay; nothing half written
