"""A model of one's own, outside the package, through the registry (trainer/models).

The slow test runs examples/tiny_model.py through the real trainer: trained, SIGKILLed after a
committed checkpoint, resumed on another mesh, then proved by the verifier on a third.
"""

import os
import signal
import time

import pytest
from jax.sharding import PartitionSpec as P

from checkpointing._src import compare, verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers
from trainer import models, train
from trainer.config import ConfigError
from trainer.program import build_mesh, build_program

USER_MODEL = "examples.tiny_model:spec"
# How far this test lets a resumed loss list drift on another layout: measured within 3.7e-7 over 40 steps.
TINY_LOSS_RTOL = 1e-5
STEPS = 100  # ~3 s of training after the first commit: room to kill the run before it ends
TRAIN_FLAGS = [f"--model={USER_MODEL}", f"--steps={STEPS}", "--save_every_steps=10", "--max_to_keep=100",
               "--batch_size=32", "--log_every_steps=10"]
FIRST_MESH = "--mesh=data=4,model=2"


@pytest.mark.parametrize("value, wrong", [
    ("resnet", "nor package.module:attribute"),
    ("no_such_package.models:spec", "module no_such_package.models not found"),
    ("examples.tiny_model:no_such_spec", "module examples.tiny_model has no attribute no_such_spec"),
    ("examples.tiny_model:NUM_CLASSES", "NUM_CLASSES is of type int, not a trainer.models.ModelSpec"),
])
def test_a_bad_model_is_one_line_naming_it(value, wrong):
    with pytest.raises(ConfigError) as raised:
        models.resolve(value)
    message = str(raised.value)
    assert message.startswith(f"--model={value}: ") and wrong in message and "\n" not in message, message


def test_built_in_names_and_a_user_model_resolve_to_their_specs():
    assert [models.resolve(name).name for name in models.BUILT_IN] == ["mlp", "transformer"]
    assert models.resolve(USER_MODEL).name == "tiny_classifier"


def test_the_specs_config_check_and_sharding_hint_are_used(workdir):
    with pytest.raises(ConfigError, match="--input_dim=10 must be a multiple of 4"):
        helpers.small_config(workdir, USER_MODEL, input_dim=10)
    with pytest.raises(ConfigError, match="--num_heads=3 does not divide --hidden_dim=32"):
        helpers.small_config(workdir, "transformer", num_heads=3)
    config = helpers.small_config(workdir, USER_MODEL)
    program = build_program(config, build_mesh(config))
    # The hint splits kernel rows over 'model' (the default rule would split their columns).
    kernel = program.state_shardings.params["Dense_0"]["kernel"]
    assert kernel.spec == P("model", None)
    assert program.state_shardings.opt_state[0].mu["Dense_0"]["kernel"].spec == P("model", None)
    assert program.state_shardings.params["Dense_0"]["bias"].spec == P()


def train_until_first_commit_then_kill(workdir: str, log_path: str) -> None:
    """Starts the trainer and SIGKILLs it as soon as one checkpoint is committed."""
    with helpers.started_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS, FIRST_MESH,
                                log_path=log_path) as proc:
        deadline = time.monotonic() + 240
        while not committed_steps(workdir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, f"the trainer ended before it could be killed:\n{open(log_path).read()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_user_model_trains_is_killed_resumes_and_verifies_on_another_mesh(tmp_path):
    reference, workdir = str(tmp_path / "uninterrupted"), str(tmp_path / "run")
    with helpers.started_module("trainer.train", f"--workdir={reference}", *TRAIN_FLAGS, FIRST_MESH,
                                log_path=str(tmp_path / "reference.log")) as uninterrupted:
        train_until_first_commit_then_kill(workdir, str(tmp_path / "killed.log"))
        resumed_from = committed_steps(workdir)[-1]
        assert resumed_from < STEPS, "killed mid-run"
        result = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS, "--mesh=data=8")
        assert result.returncode == 0, result.stderr[-3000:]
        assert uninterrupted.wait(timeout=300) == 0, open(tmp_path / "reference.log").read()[-3000:]
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]

    steps = committed_steps(workdir)
    assert steps[-1] == STEPS and read_manifest(workdir, STEPS)["mesh"] == {"data": 8, "model": 1}
    found = verdicts.read_steps(workdir, steps)
    assert {step: found[step]["level"] for step in steps} == dict.fromkeys(steps, "reproduced"), found
    assert all(verdict["status"] == "pass" for verdict in found.values()), found

    resumed, expected = recorded_losses(workdir), recorded_losses(reference)
    assert list(resumed) == list(expected) == list(range(STEPS))
    mismatch, largest = compare.compare_losses(resumed, expected, TINY_LOSS_RTOL)
    assert mismatch is None, mismatch.detail
    # Up to the resume the same layout recorded both lists: bit for bit.
    before = {step: expected[step] for step in range(resumed_from)}
    assert compare.compare_losses(resumed, before, 0.0)[0] is None
    assert expected[STEPS - 1] < expected[0] / 2, "the loss must fall"


@pytest.mark.parametrize("flags, texts", [
    (["--model=examples.tiny_model:missing"], ["--model=examples.tiny_model:missing:", "no attribute missing"]),
    (["--model=no_such_package:spec"], ["--model=no_such_package:spec: module no_such_package not found"]),
    ([f"--model={USER_MODEL}", "--input_dim=10"], ["--input_dim=10 must be a multiple of 4"]),
])
def test_the_trainer_refuses_a_bad_model_with_one_line(workdir, flags, texts):
    before = helpers.disk_state(workdir)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", *flags)
    helpers.assert_refused(result, before, *texts)
