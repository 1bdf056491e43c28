"""A new user's first week (issue 58): each documented command run as documented, on real files."""

import os

import jax
import pytest

from runtime import exit_codes
from runtime import mesh as mesh_lib
from tests import helpers
from tests.tamper import RUN_10
from verifier import layouts
from verifier.context import ProofContext, VerifierOptions


def test_a_verifier_mesh_smaller_than_the_visible_devices_runs_on_the_first_of_them(tmp_path):
    options = VerifierOptions(workdir=str(tmp_path), mesh=(("data", 2),))
    mesh = ProofContext(options, replay=None).mesh()
    assert list(mesh.devices.flat) == jax.devices()[:2]
    # the layouts it measures the noise of a layout change on stay on the same two devices
    for other in layouts.other_meshes(mesh):
        assert set(other.devices.flat) <= set(jax.devices()[:2]), dict(other.shape)
    mesh_lib.check_subset((("data", 2),), 8)
    with pytest.raises(mesh_lib.MeshError, match="has 16 devices but only 8 are visible"):
        mesh_lib.check_subset((("data", 16),), 8)


@pytest.mark.slow
def test_the_readme_verifier_command_runs_after_the_readme_set_up(trained_copy):
    """README: XLA_FLAGS fakes 8 devices, then `verifier.verify --mesh=data=2 --once` (was: exit 2)."""
    config = trained_copy(**RUN_10)
    result = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=2", "--once",
                                device_count=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verifier on 2 of 8 devices" in result.stderr, result.stderr[-3000:]
    assert os.path.exists(os.path.join(config.workdir, "verdicts", "10.json"))


def train_without_program(workdir: str, steps: int = 4) -> None:
    """A user's loop whose Checkpointer is opened without program= (documented optional)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from checkpointing import CheckpointConfig, Checkpointer

    mesh = mesh_lib.build({"data": 8})
    shardings = {"w": NamedSharding(mesh, P()), "step": NamedSharding(mesh, P())}
    init = jax.jit(lambda: {"w": jnp.ones((4,)), "step": jnp.zeros((), jnp.int32)}, out_shardings=shardings)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(init),
                            shardings)
    with Checkpointer(workdir, CheckpointConfig(save_every_steps=2), config={"seed": 0}, fixed=["seed"], mesh=mesh,
                      total_steps=steps) as checkpointer:
        state = checkpointer.restore_or_init(abstract, init).state
        for step in range(steps):
            state = {"w": state["w"] * 0.5, "step": state["step"] + 1}
            checkpointer.on_step(step + 1, state, jnp.sum(state["w"]))


def test_a_checkpointer_without_program_records_that_the_run_cannot_be_replayed(workdir, caplog):
    from checkpointing._src import workdir as workdir_lib
    from verifier import program as program_lib

    train_without_program(workdir)
    assert "Checkpointer without program=" in caplog.text
    manifest = workdir_lib.read_manifest(workdir, 4)
    assert "program" in manifest and manifest["program"] is None
    with pytest.raises(program_lib.ProgramError, match="without program="):
        program_lib.load(manifest, mesh_lib.build({"data": 8}))


@pytest.mark.slow
def test_the_verifier_names_the_missing_program_argument(workdir):
    train_without_program(workdir)
    result = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--once")
    assert result.returncode == exit_codes.UNPROVED, result.stderr[-3000:]
    assert "without program=" in result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
    assert "trainer.program:replay_program" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # flax's import and a compile: 2-5 s here
def test_the_documented_mesh_runs_a_flax_dropout_model_on_a_data_sharded_batch():
    """docs/api.md's mesh recipe: checkpointing.config.make_mesh (jax.make_mesh's Explicit axes raised
    ShardingTypeError in flax's Dropout on a P("data") batch)."""
    import flax.linen as nn
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from checkpointing.config import make_mesh

    mesh = make_mesh("data=4,model=2")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    model = nn.Sequential([nn.Dense(8), nn.Dropout(0.5, deterministic=False), nn.Dense(1)])
    batch = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    params = model.init(jax.random.key(0), batch[:1])

    @jax.jit
    def loss(params, batch, key):
        return jnp.mean(model.apply(params, batch, rngs={"dropout": key}) ** 2)

    assert bool(jnp.isfinite(loss(params, batch, jax.random.key(1))))
    assert dict(make_mesh({"data": 2}, jax.devices()[:2]).shape) == {"data": 2, "model": 1}


def test_relative_data_flags_are_recorded_absolute_globs_and_prefix_kept(tmp_path, monkeypatch):
    from trainer import model_config
    from trainer.program import validate

    monkeypatch.chdir(tmp_path)
    config = model_config.from_flat({"workdir": "run", "model": "mlp", "mesh": helpers.MESHES["data=8"],
                                    "batch_size": 32, "data": "records:corpus/train-*.array_record",
                                    "eval_data": "records:~/eval-[0-9]*.array_record"})
    config = validate(config, 8)
    assert config.workdir == str(tmp_path / "run")
    assert config.data == f"records:{tmp_path}/corpus/train-*.array_record"
    assert config.eval_data == "records:" + os.path.expanduser("~/eval-[0-9]*.array_record")
    assert validate(model_config.replace(config, data="synthetic", eval_data=""), 8).data == "synthetic"


@pytest.mark.slow
def test_a_run_on_relative_data_flags_verifies_from_another_directory(tmp_path, stdlib_corpus):
    import shutil
    import subprocess
    import sys

    from tests.records_train import lm_flags

    shutil.copytree(stdlib_corpus, tmp_path / "stdlib")
    relative = [flag.replace(stdlib_corpus, "stdlib") for flag in lm_flags(stdlib_corpus)]
    train = subprocess.run([sys.executable, "-m", "trainer.train", "--workdir=run", "--mesh=data=4,model=2",
                            "--steps=8", "--save_every_steps=8", *relative], cwd=tmp_path,
                           env=helpers.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    verify = subprocess.run([sys.executable, "-m", "verifier.verify", f"--workdir={tmp_path / 'run'}",
                             "--mesh=data=2", "--once"], cwd=elsewhere, env=helpers.subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr[-3000:]


@pytest.mark.slow
def test_the_readme_prepare_command_runs_twice_and_refuses_other_arguments(tmp_path):
    out = str(tmp_path / "stdlib")
    prepare = ["trainer.prepare", f"--out_dir={out}", "--seq_len=32", "--max_files=4"]
    first = helpers.run_module(*prepare, device_count=1)
    assert first.returncode == 0, first.stderr[-3000:]
    before = helpers.disk_state(out)
    again = helpers.run_module(*prepare, device_count=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds prepare's output of these arguments" in again.stderr
    assert helpers.disk_state(out) == before
    other = helpers.run_module(*prepare[:-1], "--max_files=5", device_count=1)
    helpers.assert_refused(other, before, "--max_files=5 (it holds 4)")


@pytest.mark.slow  # a subprocess each
@pytest.mark.parametrize("module, own", [
    ("trainer.train", ["--workdir", "--mesh", "--steps", "--save_every_steps", "--data", "--coordinator_address"]),
    ("verifier.verify", ["--workdir", "--mesh", "--once", "--follow", "--coordinator_address"]),
    ("trainer.inspect", ["--workdir", "--losses", "--plot"]),
])
def test_help_lists_the_programs_own_flags_with_their_help(module, own):
    result = helpers.run_module(module, "--help", device_count=1)
    assert result.returncode == 0, result.stderr[-3000:]
    listed = {line.split(":")[0].strip().replace("[no]", "") for line in result.stdout.splitlines()
              if line.startswith("  --")}
    assert set(own) <= listed, sorted(listed)
    assert "--jax_" not in result.stdout and "--verbosity" not in result.stdout, "a library's flags: --helpfull's"


def test_an_interrupted_intact_verdict_is_never_shown_as_replaying():
    from checkpointing._src import verdicts

    verdict = verdicts.make(step=10, level="intact", status="pass", detail="restored", checkpoint_mesh={},
                            verifier_mesh={}, durations_secs={}, complete=False)
    assert verdicts.summary(verdict) == "intact pass (replaying)"
    assert verdicts.summary({**verdict, "interrupted": True}) == "intact pass (interrupted)"


@pytest.mark.slow
def test_ctrl_c_stops_the_verifier_with_one_line_and_exit_130(trained_copy, tmp_path):
    import signal
    import time

    from checkpointing._src import verdicts
    from runtime import exit_codes

    config = trained_copy(**RUN_10)
    log = str(tmp_path / "verifier.log")
    with helpers.started_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=2", "--once",
                                "--measure_noise=false", log_path=log) as verifier:
        deadline = time.monotonic() + 120
        while verdicts.read(config.workdir, 10) is None and verifier.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not verdicts.read(config.workdir, 10)["complete"], "the replay ended before the signal"
        os.kill(verifier.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        code = verifier.wait(timeout=60)
    lines = open(log).read().strip().splitlines()
    assert code == exit_codes.INTERRUPTED, lines[-20:]
    assert lines[-1] == "verifier stopped by SIGINT: steps [10] still to prove; run it again to prove them", lines[-5:]
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), lines[-20:]
    inspected = helpers.run_module("trainer.inspect", f"--workdir={config.workdir}", device_count=1)
    assert "intact pass (interrupted)" in inspected.stdout and "replaying" not in inspected.stdout, inspected.stdout


@pytest.mark.slow
def test_a_users_loop_under_run_main_logs_quietly_and_a_held_workdir_is_one_line_exit_2(workdir, tmp_path):
    import time

    done = helpers.run_module("examples.own_loop", f"--workdir={workdir}", "--mesh=data=4,model=2", "--steps=40")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) < 20 and not any("orbax" in line.lower() for line in lines), "\n".join(lines[:40])
    log = str(tmp_path / "holder.log")
    with helpers.started_module("examples.own_loop", f"--workdir={workdir}", "--mesh=data=4,model=2",
                                "--steps=1000000", "--save_every_steps=1000", log_path=log) as holder:
        deadline = time.monotonic() + 120
        while "first checkpoint at" not in open(log).read() and holder.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holder.poll() is None, open(log).read()[-3000:]
        second = helpers.run_module("examples.own_loop", f"--workdir={workdir}", "--mesh=data=4,model=2",
                                    "--steps=1000000")
    # before: a WorkdirLeasedError traceback and exit 1 (the holder keeps renewing its lease: no disk check)
    helpers.assert_refused(second, {}, "lease")


def test_the_inspect_table_fits_120_columns_with_sizes_a_person_reads():
    from checkpointing.inspection import format_table

    def row(step, processes, mesh, resumed, verdict, size):
        return {"step": step, "bytes": size, "mesh": mesh, "processes": processes, "platform": "TPU v5 lite",
                "saved_at": "2026-12-07T08:59:26+00:00", "reason": "preemption", "resumed_from": resumed,
                "losses": "0.4817..1.161 (139)", "verdict": verdict}

    rows = [row(50, 2, "data=4,model=2", "-", "reproduced pass", 1000),  # the README's demo, its verdicts longest
            row(161, 2, "data=4,model=2", "75 (local)", "intact pass (interrupted)", 3 * 2**30 // 2),
            row(100000, 4, "data=256,model=8", "161 (persistent)", "reproduced pass", 999 * 2**20)]
    lines = format_table(rows).splitlines()
    assert max(len(line) for line in lines) <= 120, "\n".join(lines)
    assert lines[0] == "every step: platform TPU v5 lite, saved on 2026-12-07 (UTC)", lines[0]
    assert lines[1].split()[:4] == ["step", "size", "mesh", "(procs)"], lines[1]
    assert "1000 B" in lines[2] and "1.5 GiB" in lines[3] and "999.0 MiB" in lines[4] and " 08:59 " in lines[2]
    assert "data=256,model=8 (4)" in lines[4] and "161 " in lines[4] and "persistent" not in lines[4]


def test_the_plot_says_what_the_run_was_keeps_markers_visible_and_leaves_the_width_to_the_curves():
    from checkpointing._src import plot, plot_draw
    from checkpointing._src.history import Attempt

    layout = "data=4,model=2 (2 processes)"
    attempts = [Attempt(1, 0, None, layout, list(range(12)), [10.0 - s for s in range(12)]),
                Attempt(2, 10, "local", layout, list(range(10, 20)), [9.0 - s for s in range(10, 20)])]
    losses = [10.0 - s for s in range(10)] + [9.0 - s for s in range(10, 20)]
    checkpoints = [plot.Checkpoint(10, 1.0, "reproduced pass", "tab:green"),
                   plot.Checkpoint(20, -10.0, "intact pass (replaying)", "tab:cyan")]
    run = plot.Series(list(range(20)), losses, checkpoints, [], [plot.Resume(10, layout, "local")], attempts,
                      crashes=[12], eval_steps=[10, 20], eval_values=[1.0, -10.0])
    assert plot.summary(run) == ("20 steps in 2 attempts (1 crash); 2 checkpoints, 1 intact pass (replaying), "
                                 "1 reproduced pass")
    assert plot.title("/home/me/runs/lm/", run) == "runs/lm: " + plot.summary(run)
    assert plot.title("lm", run).startswith("lm: ")
    picture = plot_draw.figure(run, title=plot.title("/home/me/runs/lm/", run))
    picture.canvas.draw()
    (axes,) = picture.axes
    crash = [line for line in axes.get_lines() if line.get_linestyle() == "-."]
    assert [line.get_xdata()[0] for line in crash] == [10], "at the end of the crashed attempt's shading"
    points = {collection.get_label(): collection for collection in axes.collections if collection.get_label()}
    evals = points["eval loss (held-out batches)"]
    assert all(points[f"checkpoint: {v}"].get_zorder() > evals.get_zorder() for v in ("reproduced pass",))
    assert evals.get_facecolors().size == 0 or evals.get_facecolors()[0][3] == 0, "hollow: the checkpoint shows"
    width = axes.get_window_extent().width / picture.bbox.width
    assert width > 0.85, f"the axes take {width:.0%} of the width; the legend the rest"


def test_no_fast_test_starts_an_entry_point():
    """The fast tier stays about a minute on 2 cores: a test that runs one of our entry points as a process
    (helpers.run_module, helpers.started_module: JAX's import alone is about a second) is marked slow, as
    pyproject.toml's marker says. Found by reading each test's source, so it costs nothing to run."""
    import ast
    import pathlib

    unmarked = []
    for path in sorted(pathlib.Path(helpers.REPO_ROOT, "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0]) and "slow" in
               ast.unparse(node.value) for node in tree.body):
            continue
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")) or \
                    any("slow" in ast.unparse(decorator) for decorator in node.decorator_list):
                continue
            called = {getattr(call.func, "attr", getattr(call.func, "id", None)) for call in ast.walk(node)
                      if isinstance(call, ast.Call)}
            if called & {"run_module", "started_module"}:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, "fast tests that start an entry point (mark them slow):\n" + "\n".join(unmarked)
