"""TensorBoard holds the losses metrics.jsonl has, once each, after preemptions and kills (issue 50).

The losses pending at a preemption reach both files. An attempt resumed at step C recomputes every
step from C: before it writes, the earlier attempts' events at steps >= C are taken out of their
files (but the eval of step C, which only the attempt that saved C computed), so each step shows
once, with the value metrics.jsonl's reader returns (its last). Real trainers and real signals; the
files are read back as TensorBoard reads them (tests/test_metrics.py's reader checks every record).
"""

import os
import signal
import time

import pytest

from checkpointing._src import workdir as workdir_lib
from checkpointing._src.history import parse_metrics
from checkpointing._src.workdir import committed_steps
from runtime import exit_codes
from tests import helpers
from tests.test_metrics import read_events, tensorboard_losses
from trainer import event_files, loop

FLAGS = ["--batch_size=32", "--save_every_steps=10", "--max_to_keep=100"]


def series(events, tag: str) -> list[tuple[int, float]]:
    return [(step, value) for _, step, name, value in events if name == tag]


def write_attempt(workdir: str, resumed_from, steps, loss, extra=()):
    """One attempt's events: loss and grad_norm per step, then (step, {tag: value}) pairs; closed."""
    writer = event_files.EventWriter(workdir, resumed_from)
    for step in steps:
        writer.scalars(step, {"loss": loss(step), "grad_norm": loss(step) / 2})
    for step, values in extra:
        writer.scalars(step, values)
    writer.close()
    assert writer.enabled


def test_a_resumed_attempt_takes_back_the_steps_it_recomputes_but_the_eval_of_its_first_step(tmp_path):
    workdir = str(tmp_path)
    directory = os.path.join(workdir, workdir_lib.TENSORBOARD_DIR)
    write_attempt(workdir, None, range(15), lambda s: 1.0 + s,
                  [(9, {"steps_per_sec": 5.0}), (14, {"steps_per_sec": 5.0}), (10, {"eval/loss": 0.5}),
                   (12, {"eval/loss": 0.25})])
    (first,) = os.listdir(directory)
    with open(os.path.join(directory, first), "ab") as f:  # killed in the middle of a record
        f.write(event_files.frame(b"\x08" * 40)[:30])
    write_attempt(workdir, 10, range(10, 20), lambda s: -1.0 - s,
                  [(14, {"steps_per_sec": 7.0}), (15, {"eval/loss": 0.125})])

    events = read_events(directory)  # every record whole: the torn one went with the rewrite
    assert series(events, "loss") == [(s, 1.0 + s) for s in range(10)] + [(s, -1.0 - s) for s in range(10, 20)]
    assert series(events, "grad_norm") == [(s, (1.0 + s) / 2) for s in range(10)] + [
        (s, (-1.0 - s) / 2) for s in range(10, 20)]
    assert series(events, "steps_per_sec") == [(9, 5.0), (14, 7.0)]
    # Attempt 2 never evaluates step 10 (the state it resumed from was evaluated before its save).
    assert series(events, "eval/loss") == [(10, 0.5), (15, 0.125)]

    # A rollback to step 5: through both earlier files, newest first.
    write_attempt(workdir, 5, range(5, 8), lambda s: 100.0 + s)
    events = read_events(directory)
    assert series(events, "loss") == [(s, 1.0 + s) for s in range(5)] + [(s, 100.0 + s) for s in range(5, 8)]
    assert series(events, "eval/loss") == [] and series(events, "steps_per_sec") == []
    assert len(os.listdir(directory)) == 3, "no temporary file left beside the event files"


@pytest.mark.slow
def test_a_gs_workdirs_event_files_are_taken_back_too(gcs_env, tmp_path):
    from etils import epath

    workdir = helpers.gs_workdir("tensorboard-attempts")
    write_attempt(workdir, None, range(6), lambda s: 1.0 + s)
    write_attempt(workdir, 3, range(3, 8), lambda s: -1.0 - s)
    for remote in (epath.Path(workdir) / workdir_lib.TENSORBOARD_DIR).iterdir():
        (tmp_path / remote.name).write_bytes(remote.read_bytes())
    assert series(read_events(str(tmp_path)), "loss") == [(s, 1.0 + s) for s in range(3)] + [
        (s, -1.0 - s) for s in range(3, 8)]


def metrics_losses(workdir: str) -> list[tuple[int, float]]:
    """metrics.jsonl through the project's reader: [(step, loss)] by step, the last value of each."""
    return sorted(loop.read_metrics(workdir).items())


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def newest_commit(workdir: str):
    return committed_steps(workdir)[-1] if os.path.isdir(workdir) and committed_steps(workdir) else None


@pytest.mark.slow
def test_a_preemption_leaves_tensorboard_the_losses_metrics_jsonl_has(tmp_path, workdir, no_job_id):
    """--log_every_steps past the run: every loss is still pending when SIGTERM comes, and only the
    preemption's flush writes them (before: to metrics.jsonl, not to TensorBoard)."""
    log = str(tmp_path / "train.log")
    flags = [f"--workdir={workdir}", "--mesh=data=4,model=2", *FLAGS]
    with helpers.started_module("trainer.train", *flags, "--steps=100000", "--log_every_steps=100000",
                                log_path=log) as proc:
        wait_for(lambda: newest_commit(workdir) is not None, 240, "a first commit")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == exit_codes.PREEMPTED, open(log).read()[-3000:]
    preempted_at = newest_commit(workdir)
    assert [s for s, _ in metrics_losses(workdir)] == list(range(preempted_at))
    assert tensorboard_losses(workdir) == metrics_losses(workdir)

    resumed = helpers.run_module("trainer.train", *flags, f"--steps={preempted_at + 7}", "--log_every_steps=5")
    assert resumed.returncode == exit_codes.OK, resumed.stderr[-3000:]
    assert [s for s, _ in metrics_losses(workdir)] == list(range(preempted_at + 7))
    assert tensorboard_losses(workdir) == metrics_losses(workdir)


@pytest.mark.slow
def test_after_a_sigkill_and_a_resume_each_step_shows_once_with_the_resumed_attempts_value(
        tmp_path, workdir, no_job_id):
    """Killed some steps past a commit, resumed on another layout (data=8: the recomputed losses differ
    in their last bits): TensorBoard's list of (step, loss) is metrics.jsonl's, each step once."""
    log = str(tmp_path / "train.log")
    flags = [f"--workdir={workdir}", "--log_every_steps=1", *FLAGS]
    with helpers.started_module("trainer.train", *flags, "--mesh=data=4,model=2", "--steps=100000",
                                log_path=log) as proc:
        def logged_past_a_commit() -> bool:
            commit = newest_commit(workdir)
            return commit is not None and max((s for s, _ in tensorboard_losses(workdir, strict=False)),
                                              default=-1) >= commit + 2
        wait_for(logged_past_a_commit, 240, "TensorBoard events two steps past a commit")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    resumed_at = newest_commit(workdir)
    killed_steps = [s for s, _ in tensorboard_losses(workdir, strict=False)]
    assert max(killed_steps) > resumed_at, "the killed attempt's events past the commit: the resume takes them back"

    end = max(killed_steps) + 5
    resumed = helpers.run_module("trainer.train", *flags, "--mesh=data=8", f"--steps={end}")
    assert resumed.returncode == exit_codes.OK, resumed.stderr[-3000:]
    expected = metrics_losses(workdir)
    assert [s for s, _ in expected] == list(range(end))
    assert tensorboard_losses(workdir) == expected

    with open(workdir_lib.metrics_file(workdir)) as f:
        killed, again = parse_metrics(f.read().splitlines())[0]
    assert again.resumed_from == resumed_at
    redone = dict(zip(killed.steps, killed.losses))
    differ = [s for s, v in zip(again.steps, again.losses) if s in redone and redone[s] != v]
    assert differ, "the two layouts' recomputed losses are equal: the test cannot tell whose value TensorBoard kept"
