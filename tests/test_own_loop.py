"""A user's own loop (examples/own_loop.py) on the public Checkpointer: killed, resumed on another mesh,
preempted (exit 75), resumed again and proved by the verifier through the loop's own replay program."""

import os
import signal
import time

import pytest

from checkpointing._src import compare, verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers

STEPS = 200
LOOP = "examples.own_loop"
FLAGS = [f"--steps={STEPS}", "--save_every_steps=20"]
LOSS_RTOL = 1e-5  # examples/own_loop.py's loss_rtol: what the verifier allows across layouts


def run_until_a_new_commit(workdir: str, mesh: str, sig: int, log_path: str) -> int:
    """Starts the loop, sends `sig` once a step newer than the ones already there commits; returns its exit code."""
    before = committed_steps(workdir)
    with helpers.started_module(LOOP, f"--workdir={workdir}", f"--mesh={mesh}", *FLAGS, log_path=log_path) as proc:
        deadline = time.monotonic() + 240
        while committed_steps(workdir) == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"the loop ended before the signal:\n{open(log_path).read()[-3000:]}"
        os.kill(proc.pid, sig)
        return proc.wait(timeout=120)


@pytest.mark.slow
def test_a_users_loop_is_killed_resumed_on_another_mesh_preempted_and_proved(tmp_path):
    reference, workdir = str(tmp_path / "uninterrupted"), str(tmp_path / "run")
    with helpers.started_module(LOOP, f"--workdir={reference}", "--mesh=data=4,model=2", *FLAGS,
                                log_path=str(tmp_path / "reference.log")) as uninterrupted:
        assert run_until_a_new_commit(workdir, "data=4,model=2", signal.SIGKILL, str(tmp_path / "killed.log")) == -9
        killed_at = committed_steps(workdir)[-1]
        assert killed_at < STEPS, "the kill landed mid-run"
        # Resumed on another mesh, then SIGTERM: it saves the step it reached and exits 75 for a requeue.
        code = run_until_a_new_commit(workdir, "data=8", signal.SIGTERM, str(tmp_path / "preempted.log"))
        assert code == 75, open(tmp_path / "preempted.log").read()[-3000:]
        preempted_at = committed_steps(workdir)[-1]
        assert read_manifest(workdir, preempted_at)["reason"] == "preemption" and preempted_at < STEPS
        result = helpers.run_module(LOOP, f"--workdir={workdir}", "--mesh=data=8", *FLAGS)
        assert result.returncode == 0, result.stderr[-3000:]
        assert uninterrupted.wait(timeout=300) == 0, open(tmp_path / "reference.log").read()[-3000:]

    resumed, expected = recorded_losses(workdir), recorded_losses(reference)
    assert list(resumed) == list(expected) == list(range(STEPS))
    # Before the kill the same layout computed both lists: bit for bit; after it, another mesh.
    assert compare.compare_losses(resumed, {s: expected[s] for s in range(killed_at)}, 0.0)[0] is None
    mismatch, largest = compare.compare_losses(resumed, expected, LOSS_RTOL)
    assert mismatch is None, mismatch.detail
    assert expected[STEPS - 1] < 0.7 * expected[0], "the loss must fall"

    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = committed_steps(workdir)
    found = verdicts.read_steps(workdir, steps)
    assert {s: (found[s]["level"], found[s]["status"]) for s in steps} == dict.fromkeys(steps, ("reproduced", "pass"))
    assert read_manifest(workdir, STEPS)["program"] == "examples.own_loop:replay_program"
