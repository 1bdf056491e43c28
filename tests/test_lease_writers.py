"""One writer per workdir, with real trainers in real processes: a second trainer is refused and
changes nothing, a SIGKILLed holder is taken over at once, a trainer whose lease was taken exits
before its next save, readers never touch the lease, a pod is refused as a whole, and on gs://.
"""

import os
import re
import signal

import pytest

from checkpointing._src import lease as lease_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import WorkdirLeasedError
from checkpointing._src.workdir import committed_steps
from tests import helpers
from tests.lease_records import (committed_files, contend, files, last_line, lease_files, unchanged, wait_for,
                                 write_record)
from trainer import loop

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_job_id")]

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--log_every_steps=10", "--max_to_keep=100"]
LONG_RUN = [*TRAIN, "--steps=100000", "--save_every_steps=10"]  # runs until the test ends it


def test_second_trainer_is_refused_and_the_first_trainers_steps_are_unchanged(workdir, tmp_path):
    flags = [f"--workdir={workdir}", *LONG_RUN, "--lease_secs=600"]
    with helpers.started_module("trainer.train", *flags, log_path=str(tmp_path / "first.log")) as first:
        wait_for(lambda: committed_steps(workdir), 240, "the first trainer's first checkpoint", first)
        # Stopped, the first trainer is still the live holder, and its workdir holds still: the
        # comparison below can then demand that nothing at all changed.
        os.kill(first.pid, signal.SIGSTOP)
        helpers.wait_stopped(first.pid)  # the stop landed: no write of its is still in flight
        before, steps_before = helpers.disk_state(workdir), committed_files(workdir)
        second = helpers.run_module("trainer.train", *flags, timeout=240)
        # Checked while the first is still stopped: nothing at all may have changed.
        line = helpers.assert_refused(second, before)
        os.kill(first.pid, signal.SIGCONT)
        os.kill(first.pid, signal.SIGTERM)  # a preemption: the first saves and exits 75
        assert first.wait(timeout=240) == 75, open(tmp_path / "first.log").read()[-3000:]
    assert line.startswith(f"error: {workdir} is leased to another writer (host ")
    assert f"pid {first.pid} job none since " in line and " s)" in line
    assert unchanged(steps_before, committed_files(workdir))
    assert lease_lib.holder(workdir).released_at is not None, "exit 75 releases the lease"


def test_sigkilled_trainer_is_taken_over_at_once_on_the_same_host_and_resumes(workdir, tmp_path):
    flags = [f"--workdir={workdir}", *LONG_RUN, "--lease_secs=600"]  # expiry cannot be why it is taken
    with helpers.started_module("trainer.train", *flags, log_path=str(tmp_path / "killed.log")) as killed:
        wait_for(lambda: committed_steps(workdir), 240, "a checkpoint", killed)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    latest = committed_steps(workdir)[-1]
    assert lease_lib.holder(workdir).pid == killed.pid and lease_lib.holder(workdir).released_at is None
    result = helpers.run_module("trainer.train", *flags[:-1], f"--steps={latest + 10}", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lease_dir = workdir_lib.lease_dir(workdir)
    assert f"workdir lease: pid {killed.pid} on this host held {lease_dir} and is gone; taking it over" in result.stderr
    assert f"resumed from step {latest}" in result.stderr
    assert committed_steps(workdir)[-1] == latest + 10


def test_a_trainer_whose_lease_was_taken_over_exits_1_before_its_next_save(workdir, tmp_path):
    flags = [f"--workdir={workdir}", *TRAIN, "--steps=100000", "--save_every_steps=5", "--lease_secs=600"]
    log = tmp_path / "taken.log"
    with helpers.started_module("trainer.train", *flags, log_path=str(log)) as taken:
        wait_for(lambda: committed_steps(workdir), 240, "a checkpoint", taken)
        # A newer generation is what a writer that took over leaves (after this one stalled past its
        # expiry); renewals would notice within lease_secs/4, the check before each save at once.
        steps_before = committed_files(workdir)
        write_record(workdir, 2, host="new-node")
        assert taken.wait(timeout=120) == 1
    line = last_line(log.read_text())
    refused = re.search(r"step (\d+) not saved: lost the lease on \S+/lease \(held as generation 1\): "
                        r"generation 2 now names host new-node pid 4242 job none since ", line)
    assert refused, log.read_text()[-3000:]
    assert unchanged(steps_before, committed_files(workdir)), "a committed step changed"
    # Saves already under way when the lease was taken may still commit; none from the refused one on.
    assert all(step < int(refused.group(1)) for step in committed_steps(workdir)), committed_steps(workdir)


def test_the_verifier_and_inspect_neither_take_nor_change_the_lease(workdir):
    loop.train(helpers.small_config(workdir, steps=10, save_every_steps=5))
    write_record(workdir, 2, host="writer-node")  # a live writer holds the workdir
    before = lease_files(workdir)
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    verify = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert table.returncode == 0, table.stderr[-2000:]
    assert verify.returncode == 0, verify.stderr[-3000:]
    assert lease_files(workdir) == before


def test_a_pod_is_refused_as_a_whole(workdir):
    write_record(workdir, 1, host="other-node")
    before = files(workdir)
    result = helpers.run_module("launch.local", "--num_processes=2", "--devices_per_process=4",
                                "--peer_exit_grace_secs=30", "--", f"--workdir={workdir}", *TRAIN, "--steps=10",
                                timeout=240)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    refusals = [line for line in result.stdout.splitlines() if "error: " in line]
    assert any(line.startswith("[0] error:") and "host other-node pid 4242" in line for line in refusals), refusals
    assert any(line.startswith("[1] error:") for line in refusals), refusals
    assert files(workdir) == before


def test_the_lease_on_gcs_refuses_a_second_holder_and_only_one_contender_wins(gcs_env):
    workdir = helpers.gs_workdir("lease")
    first = lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-a", 1, None))
    try:
        with pytest.raises(WorkdirLeasedError, match=r"\(host node-a pid 1 job none since "):
            lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-b", 2, None))
        trainer = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN, "--steps=10", **gcs_env)
        line = helpers.assert_refused(trainer, helpers.disk_state())  # on gs://: committed_steps below
        assert line.startswith(f"error: {workdir} is leased to another writer (host node-a pid 1 ")
        first.renew()  # renewals go through the object generation precondition
        first.check()
    finally:
        first.release()
    won = contend(workdir, after_generation=1)  # generation 1 is released: everyone may take it
    try:
        assert len(won) == 1, f"{len(won)} contenders took generation 2"
        assert lease_lib.holder(workdir).token == won[0].record.token
    finally:
        for lease in won:
            lease.release()
    assert not committed_steps(workdir), "the refused trainer wrote nothing"
