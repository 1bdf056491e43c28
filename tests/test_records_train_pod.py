"""The transformer as a causal LM on a real corpus, on a real 2-process pod: SIGKILLed at a random
point, resumed on 4 processes x 2 devices across epoch boundaries, and the run equals the
uninterrupted one (bit-exact where the same layout computed it, within the model's tolerance
elsewhere); the verifier reproduces every checkpoint."""

import os
import random
import signal
import subprocess
import time

import pytest

from checkpointing._src.workdir import committed_steps
from checkpointing._src import verdicts
from checkpointing._src.report import recorded_losses
from tests import helpers
from tests.records_train import eval_losses, lm_flags
from tests.test_pod import pod_command, run_pod, trainer_pids, wait_for
from trainer import models

pytestmark = pytest.mark.slow

STEPS = 40  # 1280 rows of ~270 records: the run crosses an epoch boundary every ~8 steps
FLAGS = ["--mesh=data=4,model=2", f"--steps={STEPS}", "--save_every_steps=8", "--max_to_keep=100",
         "--log_every_steps=4"]


def within(a: dict[int, float], b: dict[int, float], rtol: float) -> bool:
    """Same steps, and every pair within rtol of each other (a NaN is never within)."""
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= rtol * max(abs(b[s]), 1e-12) for s in a)


def test_killed_lm_pod_resumed_on_four_processes_equals_the_uninterrupted_run(tmp_path, stdlib_corpus):
    flags = [*FLAGS, *lm_flags(stdlib_corpus)]
    reference = str(tmp_path / "reference")
    result = run_pod(2, 4, f"--workdir={reference}", *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    losses, evals = recorded_losses(reference), eval_losses(reference)
    assert sorted(losses) == list(range(STEPS)) and sorted(evals) == list(range(8, STEPS + 1, 8))
    assert "tokens/s" in result.stdout and "input_wait" in result.stdout and "eval_perplexity" in result.stdout

    workdir, rng = str(tmp_path / "run"), random.Random(2020)
    log = open(tmp_path / "pod.log", "w")
    launcher = subprocess.Popen(pod_command(2, 4, f"--workdir={workdir}", *flags), env=helpers.subprocess_env(),
                                cwd=helpers.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        pids = trainer_pids(launcher, 2)
        wait_for(lambda: 8 in committed_steps(workdir), 120, "the first checkpoint")
        time.sleep(rng.uniform(0.0, 1.0))
        for pid in pids:  # the whole pod at once, at a random point (a save may be in flight)
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        log.close()
    resumed_from = committed_steps(workdir)[-1]
    assert resumed_from < STEPS, "the kill must land before the end of the run"
    assert (resumed_from * 32) // 270 < (STEPS * 32) // 270, "the resumed steps cross an epoch boundary"

    result = run_pod(4, 2, f"--workdir={workdir}", *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resumed from step {resumed_from}" in result.stdout
    resumed, resumed_evals = recorded_losses(workdir), eval_losses(workdir)
    before = lambda d: {s: v for s, v in d.items() if s < resumed_from}  # noqa: E731
    assert before(resumed) == before(losses), "the steps the 2-process pod computed: bit-exact"
    assert {s: v for s, v in resumed_evals.items() if s <= resumed_from} == \
        {s: v for s, v in evals.items() if s <= resumed_from}
    rtol = models.resolve("transformer").cross_mesh_loss_rtol
    assert within(resumed, losses, rtol), helpers.max_relative_difference(resumed, losses)
    assert within(resumed_evals, evals, rtol), (resumed_evals, evals)
    assert evals[STEPS] < evals[8], f"the LM learns: eval loss {evals[8]} -> {evals[STEPS]}"

    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--once", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = verdicts.read_all(workdir)
    assert {s: (found[s]["level"], found[s]["status"]) for s in committed_steps(workdir)} == \
        {s: ("reproduced", "pass") for s in committed_steps(workdir)}
