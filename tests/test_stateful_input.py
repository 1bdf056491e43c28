"""A pipeline whose position is not the step (examples/stateful_input_loop.py: a filtered Grain
pipeline) checkpoints its iterator in the same Orbax step: SIGKILLed and resumed, the loss list equals
the uninterrupted run's; every step holds the iterator state the run had there; a resume on another
process count is refused by name and changes nothing; the verifier replays from the saved states and
reproduces every checkpoint, and a saved position that is wrong fails its own step."""

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing import CheckpointConfig, Checkpointer
from checkpointing.errors import InputStateError
from checkpointing._src.workdir import committed_steps
from checkpointing._src.input_state import read_input_states
from checkpointing._src import verdicts
from checkpointing._src.report import recorded_losses
from examples import stateful_input_loop as example
from tests import helpers

STEPS = 60
LOOP = "examples.stateful_input_loop"
FLAGS = [f"--steps={STEPS}", "--save_every_steps=20"]


def states_after_each_step(steps: int) -> dict[int, dict]:
    """{step: the example's iterator state once it has yielded the batches of `step` steps}, in-process."""
    iterator, found = example.input_iterator(example.CONFIG), {}
    for step in range(1, steps + 1):
        next(iterator)
        found[step] = iterator.get_state()
    return found


def run_until_a_commit(workdir: str, log_path: str) -> int:
    """Starts the loop, SIGKILLs it once its first step commits; returns its exit code."""
    with helpers.started_module(LOOP, f"--workdir={workdir}", *FLAGS, log_path=log_path) as proc:
        deadline = time.monotonic() + 240
        while not committed_steps(workdir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"the loop ended before the kill:\n{open(log_path).read()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=60)


@pytest.mark.slow
def test_a_filtered_pipeline_resumes_from_its_saved_position_is_refused_elsewhere_and_proved(tmp_path):
    reference, workdir = str(tmp_path / "uninterrupted"), str(tmp_path / "run")
    with helpers.started_module(LOOP, f"--workdir={reference}", *FLAGS,
                                log_path=str(tmp_path / "reference.log")) as uninterrupted:
        assert run_until_a_commit(workdir, str(tmp_path / "killed.log")) == -9
        killed_at = committed_steps(workdir)[-1]
        assert killed_at < STEPS, "the kill landed mid-run"
        result = helpers.run_module(LOOP, f"--workdir={workdir}", *FLAGS)
        assert result.returncode == 0 and f"resumed from step {killed_at} (persistent)" in result.stderr, \
            result.stderr[-3000:]
        assert uninterrupted.wait(timeout=300) == 0, open(tmp_path / "reference.log").read()[-3000:]

    # The same layout computed both runs: the whole loss list, bit for bit.
    resumed, expected = recorded_losses(workdir), recorded_losses(reference)
    assert list(resumed) == list(range(STEPS)) and resumed == expected
    assert expected[STEPS - 1] < 0.5 * expected[0], "the loss must fall"

    # Each step holds the state the iterator had there, and that position is not the step's.
    steps = committed_steps(workdir)
    truth = states_after_each_step(STEPS)
    saved = {step: read_input_states(workdir, step) for step in steps}
    assert saved == {step: [truth[step]] for step in steps}
    assert all(state[0]["next_index"] > step * example.CONFIG["batch"] for step, state in saved.items()), saved

    # Another process count: a 2-process pod refuses the resume naming both counts, and writes nothing.
    before = helpers.disk_state(workdir)
    pod = helpers.run_module("launch.local", "--num_processes=2", "--devices_per_process=2", f"--module={LOOP}",
                             "--", f"--workdir={workdir}", *FLAGS, f"--steps={STEPS + 20}")
    assert pod.returncode == 2, pod.stderr[-3000:]
    errors = [line for line in pod.stdout.splitlines() if "error: " in line]  # the launcher relays to stdout
    assert len(errors) == 2 and all(f"step {STEPS}: its input iterator state was saved by a 1-process run, "
                                    "this run has 2 process(es)" in line for line in errors), pod.stdout[-3000:]
    assert helpers.disk_state(workdir) == before

    # The verifier replays from each step's saved states on its own mesh and reproduces every step.
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]
    found = verdicts.read_steps(workdir, steps)
    assert {s: (found[s]["level"], found[s]["status"]) for s in steps} == dict.fromkeys(steps, ("reproduced", "pass"))
    assert [found[s]["replayed_from"] for s in steps] == [0] + steps[:-1]
    assert all("the input iterator reached the position it saved" in found[s]["detail"] for s in steps)

    # A saved position moved by one row fails its own step's proof; the next step is proved past it.
    state_file = os.path.join(workdir, "checkpoints", "40", "input_state", "process_0-of-1.json")
    moved = {"next_index": saved[40][0]["next_index"] + 1}
    with open(state_file, "w") as f:
        json.dump(moved, f)
    for step in (40, 60):
        os.remove(os.path.join(workdir, "verdicts", f"{step}.json"))
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 1, result.stderr[-3000:]
    found = verdicts.read_steps(workdir, steps)
    assert (found[40]["status"], found[40]["mismatch"]["kind"]) == ("fail", "input"), found[40]
    assert f"the step saved {moved}" in found[40]["detail"]
    assert (found[60]["level"], found[60]["status"], found[60]["replayed_from"]) == ("reproduced", "pass", 20)


@pytest.mark.slow
def test_a_two_process_pod_saves_a_state_per_process_and_one_verifier_replays_from_both(tmp_path):
    workdir = str(tmp_path / "pod")
    pod = helpers.run_module("launch.local", "--num_processes=2", "--devices_per_process=2", f"--module={LOOP}",
                             "--", f"--workdir={workdir}", "--steps=40", "--save_every_steps=20")
    assert pod.returncode == 0, pod.stdout[-3000:]
    steps = committed_steps(workdir)
    saved = {step: read_input_states(workdir, step) for step in steps}
    assert steps == [20, 40] and all(len(states) == 2 for states in saved.values()), saved
    assert saved[40][0] != saved[40][1], "each process saved its own position"
    # Back on one process: refused by name (exit 2, one line), nothing changed.
    before = helpers.disk_state(workdir)
    result = helpers.run_module(LOOP, f"--workdir={workdir}", "--steps=60")
    helpers.assert_refused(result, before, "step 40: its input iterator state was saved by a 2-process run, "
                                           "this run has 1 process(es)")
    # A one-process verifier rebuilds the global batches from both processes' states.
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]
    found = verdicts.read_steps(workdir, steps)
    assert {s: (found[s]["level"], found[s]["status"]) for s in steps} == dict.fromkeys(steps, ("reproduced", "pass"))


def test_the_iterator_state_is_saved_with_the_step_and_restored_by_name(tmp_path):
    """In-process, on a real saved step: the state Grain's handler wrote is the iterator's at that step;
    a restore sets a fresh iterator to it; another process count, or no iterator, is refused by name."""
    from checkpointing._src import input_state

    workdir = str(tmp_path / "run")
    mesh = jax.make_mesh((8,), ("data",))
    options = CheckpointConfig(save_every_steps=3, async_save=False)
    state = {"step": jax_int(0)}
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
    iterator = example.input_iterator(example.CONFIG)
    with Checkpointer(workdir, options, config={"a": 1}, fixed=["a"], mesh=mesh, total_steps=3,
                      data_iterator=iterator) as checkpointer:
        checkpointer.restore_or_init(abstract, lambda: state)
        for step in range(3):
            next(iterator)
            checkpointer.on_step(step + 1, {"step": jax_int(step + 1)})
        next(iterator)  # the loop runs ahead of the last save: the saved state is the one at step 3
    assert read_input_states(workdir, 3) == [states_after_each_step(3)[3]]

    fresh = example.input_iterator(example.CONFIG)
    with Checkpointer(workdir, options, config={"a": 1}, fixed=["a"], mesh=mesh, total_steps=6,
                      data_iterator=fresh) as checkpointer:
        assert checkpointer.restore_or_init(abstract, lambda: state).step == 3
        assert fresh.get_state() == states_after_each_step(3)[3]

    with pytest.raises(InputStateError, match="step 3: its input iterator state was saved by a 1-process run, "
                                              r"this run has 2 process\(es\)"):
        input_state.check_restorable(workdir, 3, process_count=2, has_iterator=True)
    before = helpers.disk_state(workdir)
    with pytest.raises(InputStateError, match="step 3 holds the input iterator state of processes \\[0\\] of 1: "
                                              "pass data_iterator="):
        Checkpointer(workdir, options, config={"a": 1}, fixed=["a"], mesh=mesh, total_steps=6)
    assert helpers.disk_state(workdir) == before


def jax_int(value: int) -> jax.Array:
    return jnp.asarray(value, jnp.int32)
