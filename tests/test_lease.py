"""One writer per workdir: the lease (checkpointing/lease.py) and saves that never overwrite a step.

Real trainers in real processes where the process boundary is what is tested (exit codes, a
SIGKILLed or stopped holder); the lease's own rules in-process. Hand-written lease records use the
documented JSON format, so a foreign holder "on another host" needs no second machine.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from checkpointing import lease as lease_lib
from checkpointing.errors import StepAlreadyCommittedError, WorkdirLeasedError
from checkpointing.service import committed_steps
from checkpointing.workdir import step_dir as step_path
from tests import helpers
from tests.test_gcs import gcs_env, gs_workdir  # noqa: F401  (the emulator fixture)
from trainer import checkpoints, loop
from trainer.program import build_mesh, build_program

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--log_every_steps=10", "--max_to_keep=100"]
LONG_RUN = [*TRAIN, "--steps=100000", "--save_every_steps=10"]  # runs until the test ends it


@pytest.fixture(autouse=True)
def no_job_id(monkeypatch):
    """A scheduler's job id in the test's own environment would make every trainer here "the same job"."""
    for name in lease_lib.JOB_ID_VARS:
        monkeypatch.delenv(name, raising=False)  # subprocess_env copies os.environ


def files(root: str) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes); {} if it does not exist."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def committed_files(workdir: str) -> dict[str, bytes]:
    """The files of every committed step, keyed by '<step>/<path>'."""
    return {f"{step}/{name}": data for step in committed_steps(workdir)
            for name, data in files(str(step_path(workdir, step))).items()}


def unchanged(before: dict[str, bytes], after: dict[str, bytes]) -> bool:
    """Every file of `before` is still in `after` with the same bytes."""
    return all(after.get(name) == data for name, data in before.items())


def write_record(workdir: str, generation: int, *, host: str, pid: int = 4242, job_id=None,
                 expires_in: float = 600.0, pid_namespace=None) -> dict:
    """A lease record written by hand, as a holder on `host` would have written it."""
    now = time.time()
    record = {"host": host, "pid": pid, "job_id": job_id, "token": f"hand-{generation}", "lease_secs": 600.0,
              "started_at": now - 60, "renewed_at": now, "expires_at": now + expires_in, "released_at": None,
              "pid_namespace": pid_namespace}
    os.makedirs(os.path.join(workdir, "lease"), exist_ok=True)
    with open(os.path.join(workdir, "lease", f"{generation}.json"), "w") as f:
        json.dump(record, f)
    return record


def wait_for(condition, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.slow
def test_second_trainer_is_refused_and_the_first_trainers_steps_are_unchanged(workdir, tmp_path):
    flags = [f"--workdir={workdir}", *LONG_RUN, "--lease_secs=600"]
    with helpers.started_module("trainer.train", *flags, log_path=str(tmp_path / "first.log")) as first:
        wait_for(lambda: committed_steps(workdir), 240, "the first trainer's first checkpoint", first)
        # Stopped, the first trainer is still the live holder, and its workdir holds still: the
        # comparison below can then demand that nothing at all changed.
        os.kill(first.pid, signal.SIGSTOP)
        before, steps_before = files(workdir), committed_files(workdir)
        second = helpers.run_module("trainer.train", *flags, timeout=240)
        after = files(workdir)
        os.kill(first.pid, signal.SIGCONT)
        os.kill(first.pid, signal.SIGTERM)  # a preemption: the first saves and exits 75
        assert first.wait(timeout=240) == 75, open(tmp_path / "first.log").read()[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.strip().count("\n") == 0, second.stderr
    assert second.stderr.startswith(f"error: {workdir} is leased to another writer (host ")
    assert f"pid {first.pid} job none since " in second.stderr and " s)" in second.stderr
    assert after == before, "the refused trainer changed the workdir"
    assert unchanged(steps_before, committed_files(workdir))
    assert lease_lib.holder(workdir).released_at is not None, "exit 75 releases the lease"


@pytest.mark.slow
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
    assert f"workdir lease: pid {killed.pid} on this host held {workdir}/lease and is gone; taking it over" \
        in result.stderr
    assert f"resumed from step {latest}" in result.stderr
    assert committed_steps(workdir)[-1] == latest + 10


def test_a_restart_of_the_same_job_waits_for_the_old_lease_to_expire(workdir, monkeypatch):
    old = write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=3.0)
    monkeypatch.setenv("SLURM_JOB_ID", "job-7")
    loop.train(helpers.small_config(workdir, steps=5, lease_secs=60))
    taken = lease_lib.holder(workdir)
    assert (taken.job_id, taken.pid) == ("job-7", os.getpid())
    assert taken.started_at >= old["expires_at"], "taken before the old holder's lease expired"
    assert taken.released_at is not None, "a clean exit releases the lease"


def test_a_same_job_holder_that_keeps_renewing_is_refused_after_one_expiry(workdir):
    write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=2.0)

    def sleep_while_it_renews(secs):  # the old process is alive and renews its lease meanwhile
        write_record(workdir, 1, host="old-node", job_id="job-7", expires_in=2.0)
        time.sleep(secs)

    identity = lease_lib.Identity("new-node", os.getpid(), "job-7")
    with pytest.raises(WorkdirLeasedError, match="host old-node pid 4242 job job-7 .*renewed while this job waited"):
        lease_lib.acquire(workdir, 60, identity=identity, sleep=sleep_while_it_renews)
    assert sorted(os.listdir(os.path.join(workdir, "lease"))) == ["1.json"]


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
    assert files(workdir) == before and sorted(os.listdir(workdir)) == ["lease"]


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


def contend(workdir: str, after_generation: int, contenders: int = 8) -> list:
    """`contenders` threads claim generation after_generation + 1 at the same moment; the winners."""
    barrier = threading.Barrier(contenders)
    won = []

    def contender(index: int) -> None:
        identity = lease_lib.Identity(f"node-{index}", 1000 + index, None)
        barrier.wait()
        lease = lease_lib.claim(workdir, after_generation, 60, identity=identity)
        if lease is not None:
            won.append(lease)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return won


def test_two_contenders_for_an_expired_lease_only_one_wins(workdir):
    write_record(workdir, 1, host="dead-node", expires_in=-1.0)
    won = contend(workdir, after_generation=1)
    try:
        assert len(won) == 1, f"{len(won)} contenders took generation 2"
        assert lease_lib.holder(workdir).token == won[0].record.token
        assert sorted(os.listdir(os.path.join(workdir, "lease"))) == ["1.json", "2.json"]  # no tmp files left
        with pytest.raises(WorkdirLeasedError, match=f"host {won[0].record.host} "):
            lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("late-node", 1, None))
    finally:
        for lease in won:
            lease.release()


@pytest.mark.slow
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


def test_saving_a_step_another_writer_committed_raises_and_leaves_its_bytes(workdir):
    config = helpers.small_config(workdir, steps=5)
    program = build_program(config, build_mesh(config))
    state = program.init_fn()
    os.makedirs(workdir, exist_ok=True)
    mine = checkpoints.open_service(config, program)  # lists the directory now: no steps yet
    other = checkpoints.open_service(config, program)
    other.save(5, state, losses={}, reason="interval")
    other.close()
    before = committed_files(workdir)
    with pytest.raises(StepAlreadyCommittedError, match=f"step 5 is already committed at {workdir}/checkpoints/5"):
        mine.save(5, state, losses={}, reason="interval")
    mine.close()
    assert committed_steps(workdir) == [5] and committed_files(workdir) == before


def lease_files(workdir: str) -> dict[str, tuple[bytes, int]]:
    where = os.path.join(workdir, "lease")
    return {name: (open(os.path.join(where, name), "rb").read(), os.stat(os.path.join(where, name)).st_mtime_ns)
            for name in os.listdir(where)}


@pytest.mark.slow
def test_the_verifier_and_inspect_neither_take_nor_change_the_lease(workdir):
    loop.train(helpers.small_config(workdir, steps=10, save_every_steps=5))
    write_record(workdir, 2, host="writer-node")  # a live writer holds the workdir
    before = lease_files(workdir)
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    verify = helpers.run_module("trainer.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert table.returncode == 0, table.stderr[-2000:]
    assert verify.returncode == 0, verify.stderr[-3000:]
    assert lease_files(workdir) == before


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_lease_on_gcs_refuses_a_second_holder_and_only_one_contender_wins(gcs_env):  # noqa: F811
    workdir = gs_workdir("lease")
    first = lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-a", 1, None))
    try:
        with pytest.raises(WorkdirLeasedError, match=r"\(host node-a pid 1 job none since "):
            lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-b", 2, None))
        trainer = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN, "--steps=10", **gcs_env)
        assert trainer.returncode == 2, trainer.stderr[-3000:]
        assert trainer.stderr.strip().count("\n") == 0, trainer.stderr
        assert trainer.stderr.startswith(f"error: {workdir} is leased to another writer (host node-a pid 1 ")
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


def test_a_restarted_gke_jobset_is_the_same_job_to_the_lease():
    from launch.gke import manifest

    doc = manifest.jobset("run1", "team", "img", "gs://b/run", "tpu-v5-lite-podslice", "2x4", 4, False, 3, 120,
                          None, ())
    [container] = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "JOB_ID", "value": "team/run1"} in container["env"]
