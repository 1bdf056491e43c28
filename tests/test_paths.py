"""Paths as users type them: a relative --workdir, spaces, unicode, brackets, quotes.

Every path flag is resolved once (checkpointing.config.resolve_path): a local path made absolute, or
refused with one line naming the character Orbax or TensorStore cannot round-trip. The property: every
character it accepts saves, restores and verifies; every one it refuses is refused before anything is
written, and really breaks a plain Orbax restore (so the refusal is not a guess).
"""

import json
import os
import shutil
import string
import subprocess
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from checkpointing import CheckpointConfig, ConfigError
from checkpointing.config import resolve_path
from checkpointing._src.service import CheckpointService, RunMetadata
from checkpointing._src.workdir import committed_steps, read_manifest
from tests import helpers

REFUSED = {"*", "?", "[", "\\", "\n", "\t", "\x7f"}
# Every printable ASCII character, the refused ones aside, and some beyond ASCII.
ACCEPTED = sorted(set(string.printable) - set(string.whitespace) - REFUSED - {"/"}) + [" ", "é", "日本", "🙂"]


def test_a_relative_path_is_made_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_path("runs/lm", "--workdir") == str(tmp_path / "runs" / "lm")
    assert resolve_path("./a/../b", "--workdir") == str(tmp_path / "b")
    assert resolve_path("~/runs", "--workdir") == os.path.join(os.path.expanduser("~"), "runs")
    assert resolve_path("gs://bucket/run", "--workdir") == "gs://bucket/run"
    options = CheckpointConfig(local_dir="local/{process}", init_from="other:10").validated()
    assert (options.local_dir, options.init_from) == (str(tmp_path / "local" / "{process}"), f"{tmp_path}/other:10")
    assert CheckpointConfig(init_from="other").validated().init_from == str(tmp_path / "other")


@pytest.mark.parametrize("char", sorted(REFUSED))
def test_a_character_orbax_cannot_round_trip_is_refused_naming_the_flag_and_it(char):
    with pytest.raises(ConfigError) as refused:
        resolve_path(f"runs/exp{char}1", "--workdir")
    assert str(refused.value).startswith("--workdir=") and repr(char) in str(refused.value)
    assert "\n" not in str(refused.value)  # one line, even for a newline in the path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exp[lr=0.01]", "back\\slash"])
def test_the_refused_characters_really_break_a_plain_orbax_restore(tmp_path, name):
    """Why they are refused: Orbax globs under a step's path for each process's files, and TensorStore reads
    a backslash as a separator. If Orbax learns to round-trip them, this fails: accept them then."""
    manager = ocp.CheckpointManager(str(tmp_path / name / "checkpoints"))
    tree = {"w": jnp.arange(8.0)}
    manager.save(1, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
    with pytest.raises(Exception, match="NOT_FOUND"):
        manager.restore(1, args=ocp.args.StandardRestore(jax.eval_shape(lambda: tree)))


@pytest.mark.slow
def test_every_accepted_character_saves_and_restores_leaf_for_leaf(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), sharding),
             "step": jax.device_put(jnp.array(3, jnp.int32), replicated)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    run = RunMetadata.of_run({"seed": 0}, ["seed"], {"data": 8})
    for char in ACCEPTED:
        workdir = resolve_path(str(tmp_path / f"run {char}x"), "--workdir")
        service = CheckpointService(workdir, CheckpointConfig().validated(), run=run)
        service.save(3, state, losses={2: 0.5}, reason="test")
        service.close()
        restored = CheckpointService(workdir, run=run, read_only=True).restore(3, abstract)
        assert committed_steps(workdir) == [3], char
        assert helpers.leaves_equal(restored.state, state), char


@pytest.mark.slow
def test_a_relative_workdir_full_of_odd_characters_trains_resumes_and_verifies(tmp_path):
    """The README's own command shape: a relative --workdir, from a directory of the user's, killed
    nowhere but relaunched to go further, then verified; every path the manifest records is absolute."""
    name = "runs/exp lr=0.01 (é) #1 %20 'q' \"d\" {a},b;c&d@e+f~g!h$i"
    cwd = tmp_path / "home"
    cwd.mkdir()

    def run(module, *flags, device_count=8):
        return subprocess.run(
            [sys.executable, "-m", module, f"--workdir={name}", *flags], cwd=cwd, capture_output=True,
            text=True, timeout=300, env=helpers.subprocess_env(device_count))

    first = run("trainer.train", "--steps=20", *helpers.SMALL_FLAGS)
    assert first.returncode == 0, first.stderr[-2000:]
    workdir = str(cwd / name)
    assert committed_steps(workdir) == [10, 20]
    again = run("trainer.train", "--steps=30", *helpers.SMALL_FLAGS)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from step 20 (persistent)" in again.stderr
    assert committed_steps(workdir) == [10, 20, 30]
    assert read_manifest(workdir, 30)["config"]["workdir"] == workdir
    verified = run("verifier.verify", "--mesh=data=2", "--once", device_count=2)
    assert verified.returncode == 0, verified.stderr[-2000:]
    verdicts = {step: json.loads((cwd / name / "verdicts" / f"{step}.json").read_text())["status"]
                for step in (10, 20, 30)}
    assert verdicts == {10: "pass", 20: "pass", 30: "pass"}


@pytest.mark.slow
def test_a_refused_path_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    cwd = tmp_path / "home"
    cwd.mkdir()
    before = helpers.disk_state(str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--workdir=exp[lr=0.01]", "--steps=5"], cwd=cwd,
        capture_output=True, text=True, timeout=120, env=helpers.subprocess_env())
    helpers.assert_refused(result, before, "error: --workdir='exp[lr=0.01]': a glob bracket ('[') cannot be saved")


@pytest.mark.slow
def test_a_step_linked_to_another_runs_is_refused_naming_the_link_and_its_target(trained_copy, tmp_path):
    """Retention deletes a run's old steps: through a link it would reach into another run (before, every
    relaunch failed at its first save with `error: W: [Errno None] None: 'W'`)."""
    config = trained_copy(**helpers.SHARED_RUN, steps=20)
    other = trained_copy(str(tmp_path / "other"), **helpers.SHARED_RUN, steps=20)
    link = os.path.join(helpers.checkpoint_dir(config.workdir), "10")
    target = os.path.join(helpers.checkpoint_dir(other.workdir), "10")
    shutil.rmtree(link)
    os.symlink(target, link)
    before = helpers.disk_state(config.workdir, other.workdir)
    result = helpers.run_module("trainer.train", f"--workdir={config.workdir}", "--steps=40", "--max_to_keep=1",
                                *helpers.SMALL_FLAGS)
    helpers.assert_refused(result, before, f"{link} is a symbolic link to {target}: a run's steps must be its own")
