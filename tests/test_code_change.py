"""Code identity is what computes the numbers (trainer/code.py `computation`), not where the files lie: real
trainers and verifiers on copies of the project, each run from its own copy (cwd and PYTHONPATH).

- The trainer in a copy inside another git repository, a docs-only commit there, then the verifier from
  that repository and from a copy with no git at all: every step `reproduced pass`.
- A one-line change of the learning-rate schedule, not committed: the verifier names the computation
  change (`reproduced inconclusive`, exit 0, never a fail); the run resumed across it announces it, and the
  steps after the first new-code save are proved from that save.
"""

import os
import shutil
import subprocess
import sys

import pytest

from checkpointing._src import verdicts
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime import exit_codes
from tests import helpers

FLAGS = ["--model=mlp", "--mesh=data=8", "--batch_size=16", "--hidden_dim=16", "--input_dim=16", "--num_layers=1",
         "--save_every_steps=10", "--log_every_steps=10"]
SCHEDULE = "    return optax.constant_schedule(config.learning_rate)\n"  # trainer/state.py, the one line edited


def copy_project(dest: str) -> str:
    """The project's files as this checkout has them (tracked and untracked, not ignored), copied to `dest`."""
    listed = subprocess.run(["git", "-C", helpers.REPO_ROOT, "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = os.path.join(helpers.REPO_ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))
    return dest


def git(directory: str, *args: str) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *identity, "-C", directory, *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_in(project: str, module: str, *flags: str):
    """`python -m module` with `project` as the only copy of ours on the path (cwd first on sys.path)."""
    env = helpers.subprocess_env(PYTHONPATH=project)
    return subprocess.run([sys.executable, "-m", module, *flags], env=env, cwd=project, capture_output=True,
                          text=True, timeout=300)


def verify(project: str, workdir: str, *extra: str, code: int = exit_codes.OK):
    """`verify --once`, asserting its exit code: 0 when every step is proved, UNPROVED where one is inconclusive."""
    result = run_in(project, "verifier.verify", f"--workdir={workdir}", "--mesh=data=8", "--once", *extra)
    assert result.returncode == code, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_another_commit_repository_or_none_is_the_same_computation(tmp_path):
    outer = str(tmp_path / "outer")
    project = copy_project(os.path.join(outer, "vendored", "project"))  # the project inside another repository
    git(outer, "init", "-q")
    git(outer, "add", "-A")
    git(outer, "commit", "-qm", "vendor the project")
    workdir = str(tmp_path / "run")
    trained = run_in(project, "trainer.train", f"--workdir={workdir}", "--steps=20", *FLAGS)
    assert trained.returncode == 0, trained.stderr[-3000:]
    recorded = read_manifest(workdir, 20)["config"]["code"]
    assert recorded["git_commit"] == git(outer, "rev-parse", "HEAD"), "the enclosing repository's commit"

    with open(os.path.join(project, "README.md"), "a") as f:
        f.write("\nA line of documentation.\n")
    git(outer, "commit", "-qam", "docs only")
    verify(project, workdir)
    found = verdicts.read_steps(workdir, [10, 20])
    assert all((v["level"], v["status"]) == ("reproduced", "pass") for v in found.values()), found

    plain = copy_project(str(tmp_path / "plain"))  # no git at all: no commit recorded by its verifier
    verify(plain, workdir, "--reverify=all")
    found = verdicts.read_steps(workdir, [10, 20])
    assert all((v["level"], v["status"]) == ("reproduced", "pass") for v in found.values()), found


@pytest.mark.slow
def test_a_changed_schedule_is_named_and_a_resume_across_it_starts_a_new_chain(tmp_path):
    project = copy_project(str(tmp_path / "project"))
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", *FLAGS]
    first = run_in(project, "trainer.train", *flags, "--steps=20")
    assert first.returncode == 0, first.stderr[-3000:]

    state_py = os.path.join(project, "trainer", "state.py")
    with open(state_py) as f:
        source = f.read()
    assert source.count(SCHEDULE) == 1
    with open(state_py, "w") as f:  # one line, not committed anywhere: half the learning rate
        f.write(source.replace(SCHEDULE, SCHEDULE.replace("config.learning_rate", "config.learning_rate * 0.5")))

    # The edited code cannot prove steps computed before the edit: unproved, never failed.
    result = verify(project, workdir, code=exit_codes.UNPROVED)
    assert result.stderr.splitlines()[-1].startswith("unproved: not proved: 10: reproduced inconclusive")
    for verdict in verdicts.read_steps(workdir, [10, 20]).values():
        assert (verdict["level"], verdict["status"]) == ("reproduced", "inconclusive"), verdict
        assert "computation.step" in verdict["detail"], verdict
        assert "not the one this verifier runs" in verdict["detail"], verdict

    before = helpers.disk_state(workdir)
    refused = run_in(project, "trainer.train", *flags, "--steps=40", "--refuse_code_change")
    helpers.assert_refused(refused, before, "computation.step")
    # No probes: the first new-code save has no cheap proof, so the steps after it replay from it as a new
    # chain's origin, not from a proved step.
    resumed = run_in(project, "trainer.train", *flags, "--steps=50", "--probe_steps=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "code changed since the newest checkpoint: computation.step" in resumed.stderr
    assert committed_steps(workdir) == [10, 20, 30, 40, 50]
    assert read_manifest(workdir, 40)["config"]["code"]["changed_from"][0].startswith("computation.step")

    verify(project, workdir, code=exit_codes.UNPROVED)  # 10, 20 and 30 stay unproved
    found = verdicts.read_steps(workdir, [30, 40, 50])
    # The first new-code save is the new chain's origin, never reproduced itself (the steps before it are other
    # code, so it cannot be replayed from them with this code); it is not a fail either.
    assert (found[30]["level"], found[30]["status"]) == ("reproduced", "inconclusive"), found[30]
    assert "first save of new code" in found[30]["detail"], found[30]["detail"]
    for step in (40, 50):
        assert (found[step]["level"], found[step]["status"]) == ("reproduced", "pass"), found[step]
    assert found[40]["replayed_from"] == 30 and "first save of new code" in found[40]["detail"], found[40]
