"""launch/slurm on a REAL single-node Slurm cluster (slurmctld + slurmd + munged, see tests/slurm_cluster.py).

A 2-task x 4-device training job (train.sbatch) is requeued by the scheduler mid-run
(`scontrol requeue`: Slurm ends the instance, SIGTERM reaches the trainers, they save one agreed
step and exit 75), then signalled the way the time-limit warning (--signal=TERM@120) does
(`scancel --signal=TERM`: only the trainers are signalled; the batch script sees 75 and requeues
the job itself). Each time the job comes back with SLURM_RESTART_COUNT one higher, resumes from the
step it saved, and the finished job's loss list is bit-identical to an uninterrupted local pod's
(same mesh, same process count). The verifier job (verify.sbatch), submitted up front with
--dependency=afterany on the training job, runs only once training is done and passes every step.

Needs root and Debian's slurm packages (`apt-get install -y slurmctld slurmd slurm-client munge`);
without them the cluster tests are skipped with the reason.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from checkpointing._src import verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps
from runtime import exit_codes
from tests import helpers
from tests.slurm_cluster import SlurmCluster, why_unavailable

pytestmark = pytest.mark.slow

SLURM_DIR = os.path.join(helpers.REPO_ROOT, "launch", "slurm")
TRAIN_SBATCH = os.path.join(SLURM_DIR, "train.sbatch")
VERIFY_SBATCH = os.path.join(SLURM_DIR, "verify.sbatch")
STEPS = 300
TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", f"--steps={STEPS}", "--save_every_steps=20",
         "--max_to_keep=100", "--log_every_steps=20"]


# ---- the exit-code contract of task.sh + common.sh (plain bash, no cluster needed) ------------------

def _pod_exit_code(codes):
    from launch.pod import pod_exit_code

    return pod_exit_code(codes)


def _task_exit(code: int, tmp_path) -> int:
    """task.sh's exit code when the module exits `code` (a fake interpreter stands in for Python)."""
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\nexit {code}\n")
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "CKPT_PYTHON": str(fake), "CKPT_REPO": helpers.REPO_ROOT,
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    return subprocess.run(["bash", os.path.join(SLURM_DIR, "task.sh"), "trainer.train"], env=env,
                          capture_output=True, timeout=30).returncode


def _batch_code(srun_code: int) -> int:
    script = f'source "{SLURM_DIR}/common.sh"; ckpt_pod_code {srun_code}'
    env = {"PATH": os.environ["PATH"], "CKPT_REPO": helpers.REPO_ROOT, "CKPT_PYTHON": "python3",
           "CKPT_COORDINATOR_ADDRESS": "unused:1"}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def test_scripts_parse():
    for name in ("train.sbatch", "verify.sbatch", "task.sh", "common.sh"):
        result = subprocess.run(["bash", "-n", os.path.join(SLURM_DIR, name)], capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"


def test_srun_max_of_ranked_task_codes_is_the_pod_exit_code(tmp_path):
    """srun returns the highest task exit code; task.sh ranks the codes so that this highest code,
    mapped back by the batch script, is the local pod launcher's rule (75 only if all are 0 or 75)."""
    codes = (exit_codes.OK, exit_codes.FAILURE, exit_codes.BAD_INPUT, exit_codes.PREEMPTED, 3, 137)
    ranked = {code: _task_exit(code, tmp_path) for code in codes}
    for a in codes:
        for b in codes:
            assert _batch_code(max(ranked[a], ranked[b])) == _pod_exit_code([a, b]), (a, b, ranked)
    assert _batch_code(128 + 9) == exit_codes.FAILURE, "a task killed before task.sh could rank it"


# ---- the real cluster --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    reason = why_unavailable()
    if reason:
        print(f"\ntests/test_slurm.py: skipping the Slurm cluster tests: {reason}")
        pytest.skip(reason)
    with SlurmCluster.started() as started:
        yield started
    if started.leftovers:
        print(f"\ntests/test_slurm.py: killed job processes that outlived the cluster: {started.leftovers}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same flags on an uninterrupted 2 x 4 local pod."""
    workdir = str(tmp_path_factory.mktemp("slurm-reference") / "run")
    result = subprocess.run([sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=4",
                             "--", f"--workdir={workdir}", *TRAIN], env=helpers.subprocess_env(),
                            cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = recorded_losses(workdir)
    assert sorted(losses) == list(range(STEPS))
    return losses


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["CKPT_PYTHON"] = sys.executable
    env.update(extra)
    return env


def wait_for(condition, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(poll)


def instances(output: str) -> list[str]:
    """The job's output file split into one text per instance (each starts with train.sbatch's start line)."""
    parts = re.split(r"(?m)^(?=\[train\.sbatch job \d+ restart \d+ [^\]]*\] start: )", output)
    return [part for part in parts if part.startswith("[train.sbatch")]


def preempted_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"preempted at step (\d+); its checkpoint committed", text)]


def wait_requeued(cluster, job: int, restarts: int) -> dict[str, str]:
    """Waits until the instance has fully ended and the job is PENDING again with `restarts` requeues."""
    def requeued():
        fields = cluster.job(job)
        return fields if fields.get("JobState") == "PENDING" and fields.get("Restarts") == str(restarts) else None

    return wait_for(requeued, 120, f"job {job} back in PENDING with Restarts={restarts}", poll=0.5)


def start_now(cluster, job: int) -> None:
    """`scontrol update StartTime=now` on a requeued job, no sooner than 2 s after it became PENDING.

    Requeueing revokes the old instance's job credential with a one-second resolution: an instance
    started within the same second is refused ("Killing non-startable batch JobId=N: Job credential
    revoked") and the whole job ends FAILED, never to be requeued (seen here on 22.05)."""
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def verifier_job_proved_every_step(cluster, job: int, workdir: str, output) -> str:
    """Waits for the verifier job to end; asserts it completed with exit 0, gave every committed step a
    passing verdict, and left no process behind. Returns its output."""
    fields = cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 240)
    text = output.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:] + cluster.log_tail()
    found = verdicts.read_all(workdir)
    assert sorted(found) == committed_steps(workdir), (sorted(found), committed_steps(workdir))
    assert all(v["status"] == "pass" for v in found.values()), {s: v for s, v in found.items()
                                                                 if v["status"] != "pass"}
    wait_for(lambda: not cluster.leftover_processes(), 30, "every job process to exit", poll=0.2)
    return text


def test_requeued_training_job_resumes_and_equals_the_uninterrupted_run_then_the_verifier_job_passes(
        cluster, uninterrupted, tmp_path):
    workdir = str(tmp_path / "run")
    output = tmp_path / "train.out"
    train = verify = None
    try:
        train = cluster.sbatch(
            TRAIN_SBATCH, f"--workdir={workdir}", *TRAIN, cwd=str(tmp_path),
            options=["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={output}", "--time=15"],
            env=job_env(CKPT_REPO=helpers.REPO_ROOT, CKPT_CPU_DEVICES_PER_TASK="4"))
        # The verifier as a user would chain it; CKPT_REPO defaults to the submit directory.
        verify = cluster.sbatch(
            VERIFY_SBATCH, f"--workdir={workdir}", "--mesh=data=2", "--once", cwd=helpers.REPO_ROOT,
            options=[f"--dependency=afterany:{train}", f"--output={tmp_path / 'verify.out'}", "--time=15"],
            env=job_env(CKPT_CPU_DEVICES_PER_TASK="2"))

        # 1. The scheduler requeues the running job (as preemption with PreemptMode=REQUEUE does).
        wait_for(lambda: committed_steps(workdir), 180, "the first checkpoint")
        cluster.run("scontrol", "requeue", str(train))
        fields = wait_requeued(cluster, train, 1)
        assert fields["Reason"] == "BeginTime", fields  # Slurm holds a requeued job back ~2 minutes
        first = committed_steps(workdir)[-1]
        assert first < STEPS - 1, "the requeue must land mid-run"
        start_now(cluster, train)

        # 2. The time-limit warning's signal: only the job steps get SIGTERM, and the batch script
        #    requeues the job itself when the trainers exit 75.
        cluster.wait_for_state(train, {"RUNNING"}, 60)
        wait_for(lambda: [s for s in committed_steps(workdir) if s > first], 180, "a checkpoint after the resume")
        cluster.run("scancel", "--signal=TERM", str(train))
        wait_requeued(cluster, train, 2)
        second = committed_steps(workdir)[-1]
        assert first < second < STEPS - 1, (first, second)
        start_now(cluster, train)

        fields = cluster.wait_for_state(train, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 240)
        text = output.read_text()
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:] + cluster.log_tail()
        assert fields["Restarts"] == "2"

        parts = instances(text)
        assert len(parts) == 3, text[-4000:]
        for restart, part in enumerate(parts):
            assert f"start: SLURM_RESTART_COUNT={restart}," in part.splitlines()[0]
        # Instance 0, requeued by Slurm: both processes saved the same step, and the script did not requeue again.
        assert preempted_steps(parts[0]) == [first, first], parts[0][-3000:]
        assert "srun exit 75 -> pod exit 75" in parts[0]
        assert "Slurm already ended this instance" in parts[0] and "requeueing job" not in parts[0]
        # Instance 1, signalled like the time-limit warning: it resumed, saved, and requeued itself.
        assert f"resumed from step {first} " in parts[1], parts[1][-3000:]
        assert preempted_steps(parts[1]) == [second, second], parts[1][-3000:]
        assert f"requeueing job {train}" in parts[1]
        # Instance 2 finished the run.
        assert f"resumed from step {second} " in parts[2], parts[2][-3000:]
        assert "training finished" in parts[2] and not preempted_steps(parts[2])

        assert first in committed_steps(workdir) and second in committed_steps(workdir)
        assert recorded_losses(workdir) == uninterrupted, "same mesh, same process count: bit-identical"

        # 3. The verifier job started only now (afterany waits through requeues) and proves every step.
        verify_text = verifier_job_proved_every_step(cluster, verify, workdir, tmp_path / "verify.out")
        assert "verifier done: srun exit 0 -> exit 0" in verify_text
    finally:
        for job in (train, verify):
            if job is not None:
                cluster.run("scancel", str(job), check=False)


def test_cancelled_or_bad_input_jobs_are_not_requeued(cluster, tmp_path):
    """scancel: the trainers still save and exit 75, but the job stays CANCELLED. Bad flags: exit 2, FAILED."""
    options = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--time=10"]
    env = job_env(CKPT_REPO=helpers.REPO_ROOT, CKPT_CPU_DEVICES_PER_TASK="4")
    workdir = str(tmp_path / "run")
    cancelled = bad = None
    try:
        cancelled = cluster.sbatch(TRAIN_SBATCH, f"--workdir={workdir}", *TRAIN, cwd=str(tmp_path), env=env,
                                   options=[*options, f"--output={tmp_path / 'cancelled.out'}"])
        bad = cluster.sbatch(TRAIN_SBATCH, f"--workdir={tmp_path / 'bad'}", "--mesh=data=3", "--steps=10",
                             cwd=str(tmp_path), env=env, options=[*options, f"--output={tmp_path / 'bad.out'}"])
        wait_for(lambda: committed_steps(workdir), 180, "the first checkpoint")
        cluster.run("scancel", str(cancelled))
        fields = cluster.wait_for_state(cancelled, {"CANCELLED", "COMPLETED", "FAILED", "PENDING"}, 120)
        wait_for(lambda: "trainer processes done" in (tmp_path / "cancelled.out").read_text(), 60, "the trainers")
        text = (tmp_path / "cancelled.out").read_text()
        assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", fields
        step = committed_steps(workdir)[-1]
        assert preempted_steps(text) == [step, step], text[-3000:]
        assert "Slurm already ended this instance" in text and "requeueing job" not in text

        fields = cluster.wait_for_state(bad, {"CANCELLED", "COMPLETED", "FAILED", "PENDING"}, 120)
        text = (tmp_path / "bad.out").read_text()
        assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0" and fields["Restarts"] == "0", fields
        assert "error: --mesh=data=3" in text and "srun exit 202 -> pod exit 2" in text, text[-3000:]
        assert "bad input: not requeueing" in text
    finally:
        for job in (cancelled, bad):
            if job is not None:
                cluster.run("scancel", str(job), check=False)


def test_a_job_on_an_s3_workdir_requeues_itself_resumes_equal_to_the_uninterrupted_run_and_is_proved(
        cluster, uninterrupted, s3_env, tmp_path):
    """The recipe with --workdir=s3://: srun passes the job's AWS variables on to every task, the lease and
    the checkpoints live on the S3 server, and a time-limit signal requeues the job, which resumes there."""
    workdir = helpers.s3_workdir("slurm")
    output = tmp_path / "train.out"
    train = verify = None
    try:
        train = cluster.sbatch(
            TRAIN_SBATCH, f"--workdir={workdir}", *TRAIN, cwd=str(tmp_path),
            options=["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={output}", "--time=15"],
            env=job_env(CKPT_REPO=helpers.REPO_ROOT, CKPT_CPU_DEVICES_PER_TASK="4", **s3_env))
        verify = cluster.sbatch(
            VERIFY_SBATCH, f"--workdir={workdir}", "--mesh=data=2", "--once", cwd=helpers.REPO_ROOT,
            options=[f"--dependency=afterany:{train}", f"--output={tmp_path / 'verify.out'}", "--time=15"],
            env=job_env(CKPT_CPU_DEVICES_PER_TASK="2", **s3_env))

        wait_for(lambda: committed_steps(workdir), 180, "the first checkpoint on S3")
        cluster.run("scancel", "--signal=TERM", str(train))
        wait_requeued(cluster, train, 1)
        saved = committed_steps(workdir)[-1]
        assert saved < STEPS - 1, "the signal must land mid-run"
        start_now(cluster, train)

        fields = cluster.wait_for_state(train, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 240)
        text = output.read_text()
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:] + cluster.log_tail()
        parts = instances(text)
        assert len(parts) == 2 and fields["Restarts"] == "1", text[-4000:]
        assert preempted_steps(parts[0]) == [saved, saved], parts[0][-3000:]
        assert f"resumed from step {saved} " in parts[1], parts[1][-3000:]
        assert recorded_losses(workdir) == uninterrupted, "same mesh, same process count: bit-identical"

        verifier_job_proved_every_step(cluster, verify, workdir, tmp_path / "verify.out")
    finally:
        for job in (train, verify):
            if job is not None:
                cluster.run("scancel", str(job), check=False)
