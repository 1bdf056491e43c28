"""Probe summaries in a pod (checkpointing/_src/probes.py): process 0 sums the state on the host only where its
own devices hold every leaf whole (data parallelism over processes); a leaf split across processes takes
the device pass, on every process alike (it is a collective: one process deciding otherwise would hang
the pod). Either way the verifier's cheap proof of every save passes, on another layout."""

import pytest

from checkpointing._src import probes
from checkpointing._src import verdicts
from checkpointing._src.workdir import committed_steps, read_manifest
from tests.test_pod import run_pod
from verifier.verifier import Verifier, VerifierOptions

pytestmark = pytest.mark.slow

TRAIN = ["--steps=12", "--batch_size=16", "--save_every_steps=5", "--probe_steps=2", "--max_to_keep=100",
         "--log_every_steps=4"]


@pytest.mark.parametrize("mesh, summary_pass", [("data=2", probes.HOST_PASS), ("model=2", probes.STEP_PASS)])
def test_process_zero_sums_on_the_host_only_what_it_holds_whole_and_every_save_resumes(tmp_path, mesh,
                                                                                         summary_pass):
    workdir = str(tmp_path / "run")
    result = run_pod(2, 1, f"--workdir={workdir}", f"--mesh={mesh}", *TRAIN, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert committed_steps(workdir) == [5, 10, 12]
    for step in (5, 10):
        probe = probes.for_save(workdir, step, read_manifest(workdir, step)["digest"])
        assert probe is not None and (probe["summary_pass"], probe["process_count"]) == (summary_pass, 2), probe
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),), verify_budget=0.0)).verify_pending()
    found = verdicts.read_all(workdir)
    assert [(found[s]["level"], found[s]["status"]) for s in (5, 10)] == [("resumes", "pass")] * 2, \
        [found[s]["detail"] for s in (5, 10)]
