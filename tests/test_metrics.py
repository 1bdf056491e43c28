"""Metrics people can look at: TensorBoard events, the progress line, the picture of a run."""

import contextlib
import logging
import os
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest

from checkpointing._src import workdir as workdir_lib
from checkpointing._src import plot, verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps
from tests import helpers
from trainer import event_files, loop, metrics


def read_events(directory: str, strict: bool = True) -> list[tuple[str, int, str, float]]:
    """Every scalar of the event files under `directory`, as TensorBoard reads them (files in name order,
    records in file order): [(file, step, tag, value)]. Each record's framing and both masked crc32c are
    checked (TensorBoard skips a record that fails them); `strict=False` stops quietly at a torn or
    damaged record (a file still being written) instead of failing."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    found = []
    for name in sorted(n for n in os.listdir(directory) if "tfevents" in n):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            header = data[offset:offset + 8]
            length = struct.unpack("<Q", header)[0] if len(header) == 8 else -1
            payload = data[offset + 12:offset + 12 + length]
            whole = length >= 0 and len(data) >= offset + 16 + length and (
                struct.unpack("<I", data[offset + 8:offset + 12])[0] == masked_crc32c(header)
                and struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])[0] == masked_crc32c(payload))
            if not whole:
                assert not strict, f"{name}: a torn or damaged record at byte {offset} of {len(data)}"
                break
            event = event_pb2.Event.FromString(payload)
            found += [(name, event.step, value.tag, value.simple_value) for value in event.summary.value]
            offset += 16 + length
    return found


def read_scalars(directory: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the event files under `directory` (a step written twice: its last value)."""
    scalars: dict[str, dict[int, float]] = {}
    for _, step, tag, value in read_events(directory):
        scalars.setdefault(tag, {})[step] = value
    return scalars


def tensorboard_losses(workdir: str, strict: bool = True) -> list[tuple[int, float]]:
    """[(step, loss)] as TensorBoard reads them from the workdir's event files, duplicates included."""
    directory = os.path.join(workdir, workdir_lib.TENSORBOARD_DIR)
    if not os.path.isdir(directory):
        return []
    return [(step, value) for _, step, tag, value in read_events(directory, strict) if tag == "loss"]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, trained_runs):
    """20 steps on data=4,model=2 (the shared run: saves 10, 20), then resumed to 30 on data=8, in process."""
    workdir = str(tmp_path_factory.mktemp("metrics") / "run")
    shutil.copytree(trained_runs(**helpers.SHARED_RUN, steps=20), workdir)
    loop.train(helpers.small_config(workdir, mesh="data=8", steps=30, save_every_steps=10))
    return workdir


def test_phase_lines_parse():
    log = ("I1130 12:00:00.1 123 loop.py:10] phase process_start 1.25s\n"
           "I1130 12:00:01.0 123 loop.py:11] phase compile 0.5s\n"
           "I1130 12:00:01.0 123 loop.py:11] phase bogus 9s\n")
    assert metrics.parse_phases(log) == {"process_start": 1.25, "compile": 0.5}


def test_progress_line_names_step_total_rate_eta_committed_and_verified():
    line = metrics.progress_line(49, 300, 0.25, 10.0, committed=40, verified=None)  # step 49: the 50th
    assert line.startswith("step 49 loss 0.250000 steps/s 10.00 ")
    assert "progress 50/300 (17%)" in line and "eta 0m25s" in line
    assert "last committed 40" in line and "last verified -" in line
    assert "eta ?" in metrics.progress_line(1, 10, 1.0, float("nan"), None, None)


@pytest.mark.slow
def test_tensorboard_events_hold_the_losses_of_metrics_jsonl(resumed_run):
    scalars = read_scalars(os.path.join(resumed_run, workdir_lib.TENSORBOARD_DIR))
    assert tensorboard_losses(resumed_run) == sorted(loop.read_metrics(resumed_run).items())  # each step once
    assert sorted(scalars["loss"]) == list(range(30))
    assert set(scalars["steps_per_sec"]) == {4, 9, 14, 19, 24, 29}  # at the step of each line's newest loss
    assert all(v > 0 for v in scalars["steps_per_sec"].values())
    assert all(0 < v <= 1 for v in scalars["goodput_so_far"].values())
    # The resumed run's first report reads the listing afresh (then at most every 10 s).
    assert scalars["checkpoint/last_committed_step"][24] == 20 and scalars["verifier/lag_steps"][24] == 20
    assert scalars["save/blocking_secs"][14] > 0  # the save of step 10, reported at the next log line
    assert scalars["save/commit_secs"] and all(v > 0 for v in scalars["save/commit_secs"].values())
    assert all(scalars[f"restart/{phase}_secs"] for phase in ("compile", "restore"))


@pytest.mark.slow
def test_progress_line_is_logged_at_the_log_cadence(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    loop.train(helpers.small_config(str(tmp_path / "run"), steps=10, save_every_steps=5))
    lines = [r.getMessage() for r in caplog.records if " progress " in r.getMessage()]
    assert [line.split()[1] for line in lines] == ["4", "9"]
    assert "progress 10/10 (100%) eta 0m00s" in lines[-1] and "last committed" in lines[-1]


@pytest.mark.slow  # trains 30 steps
def test_the_progress_line_shows_each_commit_the_trainer_sees_at_once_not_at_the_next_re_read(tmp_path, caplog):
    """The status is re-read every 10 s; a run this short would show "last committed -" throughout. Once the
    save of S is handed off, the save before it has committed (Orbax waits for it): every later line names it."""
    caplog.set_level(logging.INFO)
    loop.train(helpers.small_config(str(tmp_path / "run"), steps=30, save_every_steps=5, log_every_steps=1))
    shown = {}
    for record in caplog.records:
        if match := re.search(r" progress (\d+)/30 .* last committed (\S+)", record.getMessage()):
            shown[int(match[1])] = None if match[2] == "-" else int(match[2])
    assert sorted(shown) == list(range(1, 31))
    # The save of 5 * ((done - 1) // 5) started before line `done`, so the one before it had committed.
    for done in range(11, 31):
        assert shown[done] is not None and shown[done] >= 5 * ((done - 1) // 5) - 5, (done, shown)
    values = [shown[d] for d in range(11, 31)]
    assert values == sorted(values) and all(v % 5 == 0 for v in values), shown


@pytest.mark.slow
def test_tensorboard_events_reach_a_gs_workdir(gcs_env, tmp_path):
    from etils import epath

    workdir = helpers.gs_workdir("tensorboard")
    writer = event_files.EventWriter(workdir)
    for step in range(3):
        writer.scalars(step, {"loss": 1.5 - step})
    writer.close()  # uploads the staged events file whole
    local = tmp_path / "events"
    local.mkdir()
    for remote in (epath.Path(workdir) / workdir_lib.TENSORBOARD_DIR).iterdir():
        (local / remote.name).write_bytes(remote.read_bytes())
    assert writer.enabled and read_scalars(str(local))["loss"] == {0: 1.5, 1: 0.5, 2: -0.5}


@pytest.mark.slow
def test_a_failing_tensorboard_write_warns_once_and_training_goes_on(tmp_path, caplog):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / workdir_lib.TENSORBOARD_DIR).write_text("a file where the directory should be")
    result = loop.train(helpers.small_config(str(workdir), steps=15))
    assert sorted(result.losses) == list(range(15)) and committed_steps(str(workdir)) == [15]
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard events" in r.getMessage()]
    assert len(warnings) == 1, warnings


@pytest.mark.slow
def test_plot_series_are_the_manifests_losses_with_checkpoints_and_resumes(resumed_run):
    proved = verdicts.make(step=10, level="reproduced", status="pass", detail="test",
                           checkpoint_mesh={"data": 4, "model": 2}, verifier_mesh={"data": 2}, durations_secs={})
    verdicts.write(resumed_run, {**proved, "content_sha256": {".params['w']": "0" * 64}})  # as the verifier binds it
    run = plot.series(resumed_run)
    recorded = recorded_losses(resumed_run)
    assert run.loss_steps == sorted(recorded) == list(range(30))
    assert run.loss_values == [recorded[s] for s in run.loss_steps]
    assert [(c.step, c.loss, c.verdict) for c in run.checkpoints] == [
        (10, recorded[9], "reproduced pass"), (20, recorded[19], "-"), (30, recorded[29], "-")]
    assert run.checkpoints[0].colour == "tab:green"
    assert [(r.step, r.layout) for r in run.resumes] == [(20, "data=8,model=1 (1 processes)")]
    assert run.preemptions == [] and run.crashes == []


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_inspect_plot_writes_a_valid_image(resumed_run, tmp_path, suffix):
    out = str(tmp_path / f"run{suffix}")
    result = helpers.run_module("trainer.inspect", f"--workdir={resumed_run}", f"--plot={out}",
                                f"--reference={resumed_run}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == out
    if suffix == ".png":
        import matplotlib.image

        with open(out, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(out).shape
        assert (width, height) == (1200, 800)  # with --reference: the loss panel and the proof panel
    else:
        root = ElementTree.parse(out).getroot()
        assert root.tag.endswith("svg")


@pytest.mark.slow
def test_inspect_plot_bad_input_is_one_line_and_writes_nothing(resumed_run, tmp_path):
    for flags, expected in [([f"--plot={tmp_path}/run.jpg"], "must end in"),
                            ([f"--plot={tmp_path}/missing/run.png"], "does not exist"),
                            ([f"--plot={tmp_path}/run.png", f"--reference={tmp_path}/nope"], "does not exist"),
                            ([f"--reference={resumed_run}"], "--reference needs --plot")]:
        before = helpers.disk_state(str(tmp_path), resumed_run)
        result = helpers.run_module("trainer.inspect", f"--workdir={resumed_run}", *flags)
        helpers.assert_refused(result, before, expected)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs filled to the last byte (root only: CI runs as root); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        os.makedirs(mount / "run" / workdir_lib.TENSORBOARD_DIR)
        with open(mount / "filler", "wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
        yield str(mount / "run")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True, timeout=30)


def test_a_full_disk_is_the_metrics_one_warning_and_writing_stops(full_disk, caplog, capsys):
    """Events are written in the loop's thread at each flush: a full disk there is one warning and writing off,
    and nothing is left to be written at exit (no traceback over the run's last line)."""
    writer = event_files.EventWriter(full_disk)
    writer.scalars(0, {"loss": 1.0})
    writer.flush()
    assert not writer.enabled
    writer.scalars(1, {"loss": 0.5})
    writer.flush()
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard events" in r.getMessage()]
    assert len(warnings) == 1 and "no space left on device" in warnings[0], warnings
    assert "Traceback" not in capsys.readouterr().err
