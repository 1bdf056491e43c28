"""A model's source changes between two saves: the resume says what changed, and no verdict calls a step
reproduced across the change (the verifier replays with the code it runs, trainer/code.py's identity)."""

import os
import shutil

import pytest

from checkpointing._src import verdicts
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers


@pytest.mark.slow
def test_a_changed_model_source_is_named_at_the_resume_and_never_reproduced_across(tmp_path):
    package = tmp_path / "user_models"
    package.mkdir()
    source = package / "tiny_user.py"
    shutil.copy(os.path.join(helpers.REPO_ROOT, "examples", "tiny_model.py"), source)
    env = {"PYTHONPATH": f"{helpers.REPO_ROOT}{os.pathsep}{package}"}
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", "--model=tiny_user:spec", "--mesh=data=8", "--save_every_steps=10"]

    first = helpers.run_module("trainer.train", *flags, "--steps=10", **env)
    assert first.returncode == 0, first.stderr[-3000:]
    verify = ["verifier.verify", f"--workdir={workdir}", "--mesh=data=8", "--once"]
    assert helpers.run_module(*verify, **env).returncode == 0
    assert verdicts.read(workdir, 10)["level"] == "reproduced"

    with open(source, "a") as f:
        f.write("\nNUM_CLASSES = NUM_CLASSES  # the same numbers, another source: another code identity\n")
    before = helpers.disk_state(workdir)
    refused = helpers.run_module("trainer.train", *flags, "--steps=20", "--refuse_code_change", **env)
    helpers.assert_refused(refused, before, "spec_sha256")

    resumed = helpers.run_module("trainer.train", *flags, "--steps=20", **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "code changed since the newest checkpoint" in resumed.stderr and "spec_sha256" in resumed.stderr
    assert committed_steps(workdir) == [10, 20]
    code = read_manifest(workdir, 20)["config"]["code"]
    assert any(change.startswith("spec_sha256") for change in code["changed_from"])
    assert code["spec_sha256"] != read_manifest(workdir, 10)["config"]["code"]["spec_sha256"]

    result = helpers.run_module(*verify, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    found = verdicts.read_steps(workdir, [10, 20])
    assert found[10]["level"] == "reproduced", "proved before the change, with the code that computed it"
    assert (found[20]["level"], found[20]["status"], found[20]["complete"]) == ("intact", "pass", True)
    assert "the code changed" in found[20]["detail"] and "spec_sha256" in found[20]["detail"], found[20]["detail"]
