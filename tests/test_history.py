"""One step numbering, a loss history that survives retention and resumes, and the demo's picture.

The numbering (docs/training.md#step-numbering): the loss of step s is computed by the update that
takes the state's counter from s to s + 1; checkpoint N holds losses of steps below N.
"""

import json
import logging
import math
import os
import re

import pytest

from checkpointing._src import history, plot, plot_draw
from checkpointing._src.history import read_history
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.history import Attempt, parse_metrics
from checkpointing._src.workdir import committed_steps, read_manifest
from launch import outcomes
from tests import helpers
from tests.test_metrics import read_scalars
from trainer import loop, metrics

PROGRESS = re.compile(r"^step (\d+) loss ([0-9.]+) .* progress (\d+)/(\d+) ")


@pytest.fixture(scope="module")
def rolled_back_run(tmp_path_factory):
    """Attempt 1: 20 steps on data=4,model=2 saving every 5 with --max_to_keep=2 (steps 0..14 survive
    only in metrics.jsonl). Attempt 2: rolled back to step 15 and trained to 30 on data=8, so steps
    15..19 are computed twice, on two layouts. Returns (workdir, attempt 1's losses, attempt 2's
    losses, attempt 2's progress lines)."""
    workdir = str(tmp_path_factory.mktemp("history") / "run")
    kept = {"save_every_steps": 5, "max_to_keep": 2}
    first = loop.train(helpers.small_config(workdir, steps=20, **kept))
    handler, logger = _Lines(), logging.getLogger("absl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        second = loop.train(helpers.small_config(workdir, mesh="data=8", steps=30, resume_from="15", rollback=True,
                                                 **kept))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return workdir, first.losses, second.losses, [m for m in handler.messages if " progress " in m]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# --- the numbering --------------------------------------------------------------------------------

def test_progress_line_shows_the_step_whose_loss_it_prints_and_the_steps_done():
    line = metrics.progress_line(9, 10, 0.25, 10.0, committed=10, verified=None)
    assert PROGRESS.match(line).groups() == ("9", "0.250000", "10", "10")
    assert "(100%) eta 0m00s" in line


@pytest.mark.slow
def test_the_progress_line_tensorboard_metrics_jsonl_and_the_manifest_number_a_loss_alike(rolled_back_run):
    workdir, _, second, lines = rolled_back_run
    logged = {int(m.group(1)): m.group(2) for m in map(PROGRESS.match, lines)}
    done = {int(m.group(1)): int(m.group(3)) for m in map(PROGRESS.match, lines)}
    assert sorted(logged) == [19, 24, 29] and all(done[s] == s + 1 for s in logged)
    in_file = loop.read_metrics(workdir)
    scalars = read_scalars(os.path.join(workdir, workdir_lib.TENSORBOARD_DIR))
    manifest = {int(s): v for s, v in read_manifest(workdir, 30)["losses"].items()}
    assert sorted(manifest) == list(range(25, 30)), "checkpoint 30 holds the losses of steps 25..29"
    for step in (24, 29):  # the same loss under the same number everywhere
        assert logged[step] == f"{in_file[step]:.6f}" == f"{second[step]:.6f}"
        assert scalars["loss"][step] == pytest.approx(in_file[step], rel=1e-7)
    assert manifest[29] == in_file[29] == second[29]
    # The interval's other scalars sit at the progress line's step too.
    assert {19, 24, 29} <= set(scalars["steps_per_sec"])


# --- the history -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_history_survives_retention_and_the_latest_attempt_wins(rolled_back_run):
    workdir, first, second, _ = rolled_back_run
    assert committed_steps(workdir) == [25, 30], "retention deleted steps 5..20"
    expected = {**first, **second}  # attempt 2's recomputed 15..19 replace attempt 1's
    assert sorted(expected) == list(range(30))
    assert any(first[s] != second[s] for s in range(15, 20)), "two layouts: the recomputed losses differ"
    history = read_history(workdir)
    assert history.losses == expected
    assert [(a.number, a.resumed_from, a.tier, a.layout, a.steps) for a in history.attempts] == [
        (1, 0, None, "data=4,model=2 (1 processes)", list(range(20))),
        (2, 15, "persistent", "data=8,model=1 (1 processes)", list(range(15, 30)))]
    assert history.attempts[0].losses == [first[s] for s in range(20)]

    printed = helpers.run_module("trainer.inspect", f"--workdir={workdir}", "--losses")
    assert printed.returncode == 0, printed.stderr
    assert {int(s): v for s, v in json.loads(printed.stdout).items()} == expected
    assert list(json.loads(printed.stdout)) == [str(s) for s in range(30)]

    run = plot.series(workdir)
    assert run.loss_steps == list(range(30)) and run.loss_values == [expected[s] for s in range(30)]
    assert [(c.step, c.loss) for c in run.checkpoints] == [(25, expected[24]), (30, expected[29])]
    assert [(r.step, r.layout, r.tier) for r in run.resumes] == [(15, "data=8,model=1 (1 processes)", "persistent")]
    assert run.crashes == [20], "attempt 1 ended at 20 and was rolled back: its steps 15..19 were recomputed"
    assert [(start, end, a.number) for start, end, a in run.spans()] == [(0, 15, 1), (15, 30, 2)]


def test_metrics_lines_give_each_step_once_with_the_latest_attempts_value():
    lines = [json.dumps(r) for r in [
        {"attempt": 1, "resumed_from": 0, "tier": None, "layout": "data=8 (1 processes)"},
        *({"step": s, "loss": 1.0 + s, "attempt": 1} for s in range(8)),
        {"step": 5, "eval_loss": 3.5, "attempt": 1},
        {"attempt": 2, "resumed_from": 5, "tier": "local", "layout": "data=8 (1 processes)"},
        *({"step": s, "loss": 2.0 + s, "attempt": 2} for s in range(5, 10)),
        {"step": 5, "eval_loss": 3.25, "attempt": 2}]] + ["{half a li"]
    attempts, evals = parse_metrics(lines)
    assert [(a.number, a.resumed_from, a.tier, a.steps) for a in attempts] == [
        (1, 0, None, list(range(8))), (2, 5, "local", list(range(5, 10)))]
    assert evals == {5: {"eval_loss": 3.25}}
    losses = {}
    for attempt in attempts:
        losses.update(zip(attempt.steps, attempt.losses))
    assert losses == {**{s: 1.0 + s for s in range(5)}, **{s: 2.0 + s for s in range(5, 10)}}


def test_a_metrics_file_from_before_attempts_splits_where_the_step_goes_back():
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in [0, 1, 2, 3, 2, 3, 4]]
    attempts, _ = parse_metrics(lines)
    assert [a.steps for a in attempts] == [[0, 1, 2, 3], [2, 3, 4]]
    assert [a.resumed_from for a in attempts] == [None, None] and attempts[1].first_step == 2


def test_plot_series_draws_each_attempt_its_crash_and_the_eval_losses(tmp_path):
    records = [{"attempt": 1, "resumed_from": 0, "tier": None, "layout": "data=4,model=2 (2 processes)"},
               *({"step": s, "loss": 10.0 - s, "attempt": 1} for s in range(12)),
               {"step": 10, "eval_loss": 4.5, "attempt": 1},
               {"attempt": 2, "resumed_from": 10, "tier": "local", "layout": "data=4,model=2 (2 processes)"},
               *({"step": s, "loss": 9.0 - s, "attempt": 2} for s in range(10, 20)),
               {"step": 20, "eval_loss": 3.5, "attempt": 2}]
    (tmp_path / workdir_lib.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    run = plot.series(str(tmp_path))
    assert run.loss_steps == list(range(20))
    assert run.loss_values == [10.0 - s for s in range(10)] + [9.0 - s for s in range(10, 20)]
    assert run.crashes == [12], "attempt 1 logged up to step 11 and attempt 2 resumed at 10"
    assert [(r.step, r.tier) for r in run.resumes] == [(10, "local")]
    assert (run.eval_steps, run.eval_values) == ([10, 20], [4.5, 3.5])
    out = tmp_path / "run.png"
    plot_draw.draw(run, str(out), title="run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- where the picture draws each fault ------------------------------------------------------------

def _save(workdir: str, step: int, losses: range, reason: str, mesh: dict, resumed_from: tuple | None) -> None:
    """A real committed save of a tiny state, whose manifest records `losses` (loss = 1 / (step + 1)) and
    the attempt it came from, as the trainer's would."""
    import jax.numpy as jnp

    from checkpointing.config import CheckpointConfig
    from checkpointing._src.service import CheckpointService, RunMetadata

    run = RunMetadata(config={"model": "test"}, fixed_fields={}, fixed_hash="test", mesh=mesh)
    service = CheckpointService(workdir, CheckpointConfig(max_to_keep=100), run=run)
    extra = {"resumed_from": {"step": resumed_from[0], "tier": resumed_from[1]}} if resumed_from else None
    service.save(step, {"w": jnp.zeros((8,), jnp.float32)}, losses={s: 1.0 / (s + 1) for s in losses},
                 reason=reason, extra=extra)
    service.close()


FIRST, OTHER = {"data": 4, "model": 2}, {"data": 8}


@pytest.fixture(scope="module")
def killed_then_preempted(tmp_path_factory):
    """The demo's story, small: attempt 1 (fresh) commits 10 and is killed once its local step 15 is
    committed, having logged steps 0..14; attempt 2 resumes from local 15 (carrying losses 10..14 to its
    first persistent save), commits 20 and 30 and is preempted at 33, but the appends of its last losses
    (30..32) failed; attempt 3 resumes from the preemption checkpoint on another layout and ends at 50."""
    workdir = str(tmp_path_factory.mktemp("faults") / "run")
    _save(workdir, 10, range(0, 10), "interval", FIRST, None)
    for step, losses, reason in ((20, range(10, 20), "interval"), (30, range(20, 30), "interval"),
                                 (33, range(30, 33), "preemption")):
        _save(workdir, step, losses, reason, FIRST, (15, "local"))
    _save(workdir, 40, range(33, 40), "interval", OTHER, (33, "persistent"))
    _save(workdir, 50, range(40, 50), "final", OTHER, (33, "persistent"))
    first, other = "data=4,model=2 (1 processes)", "data=8 (1 processes)"
    records = [history.attempt_record(1, 0, None, first), *_losses(1, range(0, 15)),
               history.attempt_record(2, 15, "local", first), *_losses(2, range(15, 30)),
               history.attempt_record(3, 33, "persistent", other), *_losses(3, range(33, 50))]
    metrics_path = os.path.join(workdir, workdir_lib.METRICS_FILE)
    with open(metrics_path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return workdir


def _losses(attempt: int, steps: range) -> list[dict]:
    return [{"step": s, "loss": 1.0 / (s + 1), "attempt": attempt} for s in steps]


def test_each_fault_is_drawn_where_its_attempt_stopped_not_where_the_next_one_ended(killed_then_preempted):
    run = plot.series(killed_then_preempted)
    killed, resumed, _ = run.attempts
    assert killed.last_step == 14 and killed.reached == 15
    assert run.crashes == [killed.reached] == [15], "the kill: where the killed attempt's own records end"
    assert resumed.last_step == 29, "its last appends failed: its records stop short of the preemption"
    assert run.preemptions == [33], "the resumed attempt ended at its preemption checkpoint, not in a crash"
    assert [(r.step, r.tier) for r in run.resumes] == [(15, "local"), (33, "persistent")]
    assert [(start, end, a.number) for start, end, a in run.spans()] == [(0, 15, 1), (15, 33, 2), (33, 50, 3)]


def test_without_metrics_the_kill_is_drawn_where_the_carried_losses_of_the_killed_attempt_end(
        killed_then_preempted, tmp_path):
    """A gs:// workdir has no metrics.jsonl: the attempts come from the manifests, and the losses attempt 2
    carried from attempt 1's local step (10..14) are attempt 1's records."""
    import shutil

    workdir = str(tmp_path / "run")
    shutil.copytree(killed_then_preempted, workdir)
    os.remove(os.path.join(workdir, workdir_lib.METRICS_FILE))
    run = plot.series(workdir)
    assert [(a.first_step, a.steps[0], a.last_step) for a in run.attempts] == [(0, 0, 14), (15, 15, 32), (33, 33, 49)]
    assert run.crashes == [15] and run.preemptions == [33]
    assert run.loss_steps == list(range(50))


def _title_inside(picture) -> tuple:
    """(the title's box, the figure's box, the box of everything drawn), in display units, after a draw."""
    picture.canvas.draw()
    (title,) = [t for t in picture.texts if t.get_text()]
    renderer = picture.canvas.get_renderer()
    return title.get_window_extent(renderer), picture.bbox, picture.get_tightbbox(renderer)


@pytest.mark.parametrize("title", [
    "demo-20250101-120000: the job crashed, resumed from its local tier, was preempted, resumed on another layout",
    "/mnt/checkpoints/" + "a-very-long-workdir-name_" * 12 + ": the job crashed, resumed from its local tier",
])
def test_the_title_fits_inside_the_picture(killed_then_preempted, title):
    run = plot.series(killed_then_preempted)
    proof = plot.proof_series(run, (run.loss_steps, run.loss_values), tolerance=1e-5)
    picture = plot_draw.figure(run, title=title, reference=(run.loss_steps, run.loss_values), proof=proof)
    title_box, figure_box, drawn = _title_inside(picture)
    for box in (title_box, drawn):
        assert (figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 and figure_box.y0 <= box.y0
                and box.y1 <= figure_box.y1), f"{box} is not inside the figure {figure_box}"
    axes_top = max(axes.get_window_extent().y1 for axes in picture.axes)
    assert title_box.y0 >= axes_top, "the title sits above the panels, not over them"


# --- the picture's proof panel ---------------------------------------------------------------------

def test_the_proof_panel_puts_exact_zeros_on_the_floor_and_names_the_tolerance():
    run = plot.Series([0, 1, 2, 3, 4], [1.0, 2.0, 3.0003, float("nan"), 5.00001], [], [], [],
                      attempts=[Attempt(1, 0, None, "data=8 (1 processes)", [0, 1, 2, 3, 4], [])])
    reference = ([0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    proof = plot.proof_series(run, reference, tolerance=1e-5)
    assert proof.steps == [0, 1, 2, 3, 4]
    assert proof.differences[:2] == [0.0, 0.0] and proof.differences[2] == pytest.approx(1e-4, rel=1e-6)
    assert math.isnan(proof.differences[3]) and proof.differences[4] == pytest.approx(2e-6, rel=1e-5)
    assert proof.floor == 1e-8, "two decades below the smallest nonzero difference (2e-6)"
    assert proof.ceiling == 1e-3, "a decade above the largest finite one (1e-4)"
    assert proof.plotted == [1e-8, 1e-8, proof.differences[2], 1e-3, proof.differences[4]]
    assert proof.exact_steps == [0, 1] and proof.tolerance == 1e-5


def test_the_proof_panel_of_a_bit_identical_run_sits_on_the_floor_below_the_tolerance():
    run = plot.Series([0, 1, 2], [1.0, 2.0, 3.0], [], [], [])
    proof = plot.proof_series(run, ([0, 1, 2], [1.0, 2.0, 3.0]), tolerance=1e-5)
    assert proof.plotted == [proof.floor] * 3 and proof.floor < proof.tolerance and proof.exact_steps == [0, 1, 2]


# --- the demo's crash line -------------------------------------------------------------------------

def test_the_demo_names_a_sigkill_as_the_crash_cause_not_the_pods_requeue_code():
    log = ("[0] Fatal Python error: Aborted\n"
           "W1201 pod.py:148] process(es) [1] were killed by SIGKILL from outside the pod (lost); ...\n"
           "I1201 pod.py:150] pod exit codes [-6, -9] -> 75\n")
    line = outcomes.exit_line("crashed job", 75, log)
    assert line == ("crashed job: process 0 aborted by the runtime (SIGABRT), process 1 killed by SIGKILL; "
                    "the pod exited 75 (requeue me)")
    assert outcomes.exit_line("preempted job", 75, "pod exit codes [75, 75] -> 75") == (
        "preempted job: process 0 exit 75 (preempted), process 1 exit 75 (preempted); the pod exited 75 (requeue me)")
    assert outcomes.exit_line("verifier", 0, "no launcher line") == "verifier: the pod exited 0 (success)"
