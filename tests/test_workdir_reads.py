"""A start-up lists the committed steps once and reads each manifest once (checkpointing.Workdir).

Before the Workdir, a relaunch listed its checkpoints about eight times and read the newest manifest
five to seven times before its first step (the restore's candidates, the run's identity, `init_from`,
the trainer's data and code checks, the restore itself): each a round trip on gs://. Counted here
where the reads reach the storage (tests/workdir_reads_child.py), and on gs:// also by the server.
"""

import json

import pytest

from tests import gcs_emulator, helpers

pytestmark = pytest.mark.slow

FLAGS = ["--mesh=data=2", "--batch_size=8", "--save_every_steps=10", "--log_every_steps=10"]


def relaunch_counted(workdir: str, tmp_path, before_relaunch=lambda: None, **env) -> dict:
    """Trains 30 steps into `workdir`, then relaunches to 40 with the reads counted until its first step."""
    first = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=30", *FLAGS, device_count=2, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    before_relaunch()
    out = tmp_path / "reads.json"
    resumed = helpers.run_module("tests.workdir_reads_child", f"--workdir={workdir}", "--steps=40", *FLAGS,
                                 device_count=2, READS_OUT=str(out), READS_WORKDIR=workdir, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 30" in resumed.stderr
    return json.loads(out.read_text())


def test_a_relaunch_lists_once_and_reads_the_newest_manifest_once_on_a_local_disk(tmp_path):
    workdir = str(tmp_path / "run")
    counts = relaunch_counted(workdir, tmp_path)
    assert counts["start"] == 30
    assert counts["listings"] == {workdir: 1}
    assert counts["manifests"] == {f"{workdir}:30": 1}, "only the step resumed is read, once"


def test_a_relaunch_lists_once_and_reads_the_newest_manifest_once_on_gcs(gcs_env, tmp_path):
    workdir = helpers.gs_workdir("reads")
    url = gcs_env["STORAGE_EMULATOR_HOST"]
    counts = relaunch_counted(workdir, tmp_path, lambda: gcs_emulator.request_log(url, clear=True), **gcs_env)
    assert counts["listings"] == {workdir: 1}
    assert counts["manifests"] == {f"{workdir}:30": 1}
    # The server's own count, from the relaunch to the object it asks for once its start-up is over.
    name = workdir[len("gs://"):].split("/", 1)[1]
    log = gcs_emulator.request_log(url)
    ended = next(i for i, entry in enumerate(log) if entry["name"] == f"{name}/startup-over")
    read = [entry["name"] for entry in log[:ended] if entry["op"] == "read" and entry["name"].endswith("/metadata")
            and "/manifest/" in entry["name"]]
    assert read == [f"{name}/checkpoints/30/manifest/metadata"]
