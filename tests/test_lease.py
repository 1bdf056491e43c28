"""One writer per workdir: the lease's own rules (checkpointing/_src/lease.py), in this process.

Real trainers in real processes, where the process boundary is what is tested: test_lease_writers.py.
"""

import json
import os
import subprocess
import time

import pytest

from checkpointing._src import lease as lease_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import StepAlreadyCommittedError, WorkdirLeasedError
from checkpointing._src.workdir import committed_steps
from tests import helpers
from tests.lease_records import committed_files, contend, files, write_record
from trainer import loop
from trainer.program import build_mesh, build_program

pytestmark = pytest.mark.usefixtures("no_job_id")


@pytest.mark.slow
def test_a_restart_of_the_same_job_waits_for_the_old_lease_to_expire(workdir, monkeypatch):
    old = write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=3.0)
    monkeypatch.setenv("SLURM_JOB_ID", "job-7")
    loop.train(helpers.small_config(workdir, steps=5, lease_secs=60))
    taken = lease_lib.holder(workdir)
    assert (taken.job_id, taken.pid) == ("job-7", os.getpid())
    assert taken.started_at >= old["expires_at"], "taken before the old holder's lease expired"
    assert taken.released_at is not None, "a clean exit releases the lease"


@pytest.mark.slow
def test_a_same_job_holder_that_keeps_renewing_is_refused_after_one_expiry(workdir):
    write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=2.0)

    def sleep_while_it_renews(secs):  # the old process is alive and renews its lease meanwhile
        write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=2.0)
        time.sleep(secs)

    identity = lease_lib.Identity("new-node", os.getpid(), "job-7")
    with pytest.raises(WorkdirLeasedError, match="host old-node pid 4242 job job-7 .*renewed while this job waited"):
        lease_lib.acquire(workdir, 60, identity=identity, sleep=sleep_while_it_renews)
    assert sorted(os.listdir(workdir_lib.lease_dir(workdir))) == ["1.json"]


@pytest.mark.parametrize("job", [None, "another-job"])
def test_a_live_foreign_holder_is_refused_at_once_and_nothing_changes(workdir, monkeypatch, job):
    write_record(workdir, 1, host="other-node", job_id="job-7")
    if job:
        monkeypatch.setenv("SLURM_JOB_ID", job)
    config = helpers.small_config(workdir, steps=5)
    before = files(workdir)
    with pytest.raises(WorkdirLeasedError) as refused:
        loop.train(config)
    assert str(refused.value).startswith(f"{workdir} is leased to another writer (host other-node pid 4242 "
                                         "job job-7 since ")
    assert files(workdir) == before and sorted(os.listdir(workdir)) == [workdir_lib.LEASE_DIR]


def test_a_dead_pid_is_taken_over_at_once_only_in_the_same_pid_namespace(workdir):
    me = lease_lib.Identity.of_this_process()
    dead_pid = int(subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout)
    # A restarted container on the same machine: same host name, its own pid namespace.
    write_record(workdir, 1, host=me.host, pid=dead_pid, pid_namespace="another-boot/pid:[1]")
    with pytest.raises(WorkdirLeasedError, match=f"host {me.host} pid {dead_pid} "):
        lease_lib.acquire(workdir, 60)
    write_record(workdir, 1, host=me.host, pid=dead_pid, pid_namespace=me.pid_namespace)
    lease = lease_lib.acquire(workdir, 60)
    try:
        assert lease.generation == 2 and lease_lib.holder(workdir).pid == os.getpid()
    finally:
        lease.release()


def test_two_contenders_for_an_expired_lease_only_one_wins(workdir):
    write_record(workdir, 1, host="dead-node", expires_in=-1.0)
    won = contend(workdir, after_generation=1)
    try:
        assert len(won) == 1, f"{len(won)} contenders took generation 2"
        assert lease_lib.holder(workdir).token == won[0].record.token
        assert sorted(os.listdir(workdir_lib.lease_dir(workdir))) == ["1.json", "2.json"]  # no tmp files left
        with pytest.raises(WorkdirLeasedError, match=f"host {won[0].record.host} "):
            lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("late-node", 1, None))
    finally:
        for lease in won:
            lease.release()


@pytest.mark.slow
def test_saving_a_step_another_writer_committed_raises_and_leaves_its_bytes(workdir):
    config = helpers.small_config(workdir, steps=5)
    program = build_program(config, build_mesh(config))
    state = program.init_fn()
    os.makedirs(workdir, exist_ok=True)
    mine = helpers.open_service(config, program)  # lists the directory now: no steps yet
    other = helpers.open_service(config, program)
    other.save(5, state, losses={}, reason="interval")
    other.close()
    before = committed_files(workdir)
    committed_at = workdir_lib.step_dir(workdir, 5)
    with pytest.raises(StepAlreadyCommittedError, match=f"step 5 is already committed at {committed_at}"):
        mine.save(5, state, losses={}, reason="interval")
    mine.close()
    assert committed_steps(workdir) == [5] and committed_files(workdir) == before


@pytest.mark.slow
def test_a_restarted_gke_jobset_is_the_same_job_to_the_lease():
    # Run as the command: launch.gke.manifest's flags would clash with the trainer's in this process.
    result = helpers.run_module("launch.gke.manifest", "--name=run1", "--namespace=team", "--image=img",
                                "--workdir=gs://bucket/run", "--tpu_topology=2x4", timeout=60)
    assert result.returncode == 0, result.stderr
    jobset = json.loads("\n".join(line for line in result.stdout.split("\n---\n")[0].splitlines()
                                  if not line.startswith("#")))
    [container] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "JOB_ID", "value": "team/run1"} in container["env"]
