"""The CNN of examples/cnn_model.py (BatchNorm, dropout, AdamW + warmup-cosine + clipping + gradient
accumulation) through the real trainer: SIGKILLed at a random point, resumed on another mesh within
its tolerance, resumed on the same mesh in the middle of an accumulation window bit for bit, every
checkpoint reproduced by the verifier on a third mesh, and batch_stats restored and moving."""

import os
import random
import signal
import time

import jax
import numpy as np
import pytest

from checkpointing._src import compare, verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers
from trainer import loop

CNN = "examples.cnn_model:spec"
# How far this test lets the resumed loss list drift on another layout: measured over 20 steps (AdamW,
# warmup-cosine, clipping, accumulation 2) on data=8 and data=2,model=4, within 2.5e-7; ~400x over.
CNN_LOSS_RTOL = 1e-4
STEPS = 30
FLAGS = [f"--model={CNN}", f"--steps={STEPS}", "--save_every_steps=5", "--max_to_keep=100", "--batch_size=32",
         "--log_every_steps=5", "--optimizer=adamw", "--weight_decay=1e-4", "--lr_schedule=warmup_cosine",
         "--warmup_steps=4", "--lr_decay_steps=15", "--grad_clip_norm=1.0", "--grad_accum_steps=2",
         "--learning_rate=1e-2", "--dropout_rate=0.2"]
OVERRIDES = dict(steps=STEPS, save_every_steps=5, max_to_keep=100, optimizer="adamw", weight_decay=1e-4,
                 lr_schedule="warmup_cosine", warmup_steps=4, lr_decay_steps=15, grad_clip_norm=1.0,
                 grad_accum_steps=2, learning_rate=1e-2, dropout_rate=0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{reference, resumed, resumed_from}: an uninterrupted run on data=4,model=2 and one SIGKILLed at a
    random point after its first commit, resumed on data=8."""
    root = tmp_path_factory.mktemp("cnn")
    reference, workdir = str(root / "reference"), str(root / "run")
    with helpers.started_module("trainer.train", f"--workdir={reference}", *FLAGS, "--mesh=data=4,model=2",
                                log_path=str(root / "reference.log")) as uninterrupted:
        with helpers.started_module("trainer.train", f"--workdir={workdir}", *FLAGS, "--mesh=data=4,model=2",
                                    log_path=str(root / "killed.log")) as proc:
            deadline = time.monotonic() + 240
            while not committed_steps(workdir) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(random.uniform(0.0, 0.5))  # a random point after the first commit
            assert proc.poll() is None, open(root / "killed.log").read()[-3000:]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        resumed_from = committed_steps(workdir)[-1]
        assert resumed_from < STEPS, "killed mid-run"
        result = helpers.run_module("trainer.train", f"--workdir={workdir}", *FLAGS, "--mesh=data=8")
        assert result.returncode == 0, result.stderr[-3000:]
        assert uninterrupted.wait(timeout=300) == 0, open(root / "reference.log").read()[-3000:]
    return {"reference": reference, "resumed": workdir, "resumed_from": resumed_from}


@pytest.mark.slow
def test_killed_and_resumed_on_another_mesh_within_tolerance_and_verified_on_a_third(runs):
    workdir = runs["resumed"]
    resumed, expected = recorded_losses(workdir), recorded_losses(runs["reference"])
    assert list(resumed) == list(expected) == list(range(STEPS))
    rtol = CNN_LOSS_RTOL
    mismatch, _ = compare.compare_losses(resumed, expected, rtol)
    assert mismatch is None, mismatch.detail
    before = {step: expected[step] for step in range(runs["resumed_from"])}
    assert compare.compare_losses(resumed, before, 0.0)[0] is None  # same layout up to the kill: bit for bit
    assert expected[STEPS - 1] < expected[0], "the loss must fall"
    assert read_manifest(workdir, STEPS)["mesh"] == {"data": 8, "model": 1}

    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once", device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = committed_steps(workdir)
    found = verdicts.read_steps(workdir, steps)
    assert {step: found[step]["level"] for step in steps} == dict.fromkeys(steps, "reproduced"), found
    assert all(verdict["status"] == "pass" for verdict in found.values()), found


@pytest.mark.slow
def test_a_resume_inside_an_accumulation_window_is_bit_exact_and_restores_batch_stats(runs, tmp_path):
    workdir = str(tmp_path / "run")
    config = helpers.small_config(workdir, CNN, **{**OVERRIDES, "steps": 13})  # 13: mid-window (2 per update)
    loop.train(config)
    config = helpers.small_config(workdir, CNN, **OVERRIDES)
    program = loop.build_program(config, loop.build_mesh(config))
    with loop.open_checkpointer(config, program.mesh) as checkpointer:  # its own watchdog, stopped at close
        start = checkpointer.restore_or_init(program.abstract_state, program.init_fn)
    assert start.step == 13 and int(start.state.opt_state.mini_step) == 1  # one gradient accumulated
    restored, initial = helpers.leaves_by_path(start.state), helpers.leaves_by_path(program.init_fn())
    stats = [path for path in restored if path.startswith(".model_state['batch_stats']")]
    assert len(stats) == 4, sorted(restored)
    assert all(not np.array_equal(restored[path], initial[path]) for path in stats)
    assert np.any(restored[".opt_state.acc_grads['Dense_0']['kernel']"] != 0)
    del start
    loop.train(config)
    resumed, expected = loop.read_metrics(workdir), recorded_losses(runs["reference"])
    assert compare.compare_losses(resumed, expected, 0.0)[0] is None, (resumed, expected)
    assert jax.device_count() == 8
