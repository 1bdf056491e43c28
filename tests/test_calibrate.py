"""Tolerances from measurement: `python -m verifier.calibrate` measures the genuine drift across
layouts against seed 003's broken resumes and writes what a spec carries; the bfloat16 transformer's
genuine steps pass the verifier's state rule across layouts with its measured rule, broken ones fail."""

import json

import jax
import pytest

from checkpointing._src import compare
from tests import helpers
from trainer import models
from trainer.models import mlp
from verifier import drift, tolerances

MLP_RUN = ("--model=mlp", "--meshes=data=4,model=2;data=8", "--windows=1,2,4", "--steps=10", "--batch_size=32")


@pytest.mark.slow
def test_the_command_writes_tolerances_above_the_drift_and_below_every_broken_signal(tmp_path):
    out = tmp_path / "tolerances.json"
    result = helpers.run_module("verifier.calibrate", *MLP_RUN, f"--out={out}", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "provable across layouts" in result.stdout and "cross_mesh_state_rtol" in result.stdout
    measured = json.loads(out.read_text())
    rows = measured["per_window"]
    loss_rtol, state_rtol = measured["cross_mesh_loss_rtol"], measured["cross_mesh_state_rtol"]
    init_loss_rtol, init_state_rtol = measured["cross_mesh_init_loss_rtol"], measured["cross_mesh_init_state_rtol"]
    assert [row["steps"] for row in rows] == [1, 2, 4] and measured["provable_across_layouts"]
    assert measured["first_interval_provable_across_layouts"] and measured["fixed_fields"]["model"] == "mlp"
    # The genuine replays on data=8 are within what the spec will carry, at every window: from the
    # saved step within the ordinary pair, from the init (a full proof's first interval) within its own.
    for drift_name, rtol in (("loss_drift", loss_rtol), ("init_loss_drift", init_loss_rtol),
                             ("state_drift", state_rtol), ("init_state_drift", init_state_rtol)):
        assert [row["steps"] for row in rows if not (row[drift_name] <= rtol)] == [], drift_name
    assert init_loss_rtol >= loss_rtol and init_state_rtol >= state_rtol, "never stricter than the ordinary pair"
    assert state_rtol == pytest.approx(10 * max(row["state_drift"] for row in rows)), "the saved step's drift only"
    # Every broken resume is above it: by the state at every window, by the loss too from 2 steps on
    # (broken moments change the loss one step late, seed 003).
    state_caught = [[row["state_signal"][kind] > state_rtol for kind in drift.BROKEN] for row in rows]
    loss_caught = [[row["loss_signal"][kind] > loss_rtol for kind in drift.BROKEN] for row in rows[1:]]
    assert state_caught == [[True] * 3] * 3 and loss_caught == [[True] * 3] * 2, rows
    assert [row["loss_signal"]["zeroed_moments"] <= loss_rtol for row in rows[:1]] == [True], "seed 003: one step late"
    # What a spec reads: the same numbers, its noise rule included.
    loss, state = models.load_tolerances(str(out))
    assert (loss, float(state)) == (loss_rtol, state_rtol)
    init_loss, init_state = models.load_tolerances(str(out), from_init=True)
    assert (init_loss, float(init_state)) == (init_loss_rtol, init_state_rtol)
    assert tolerances.noise_rule(init_state) == tolerances.noise_rule(state)
    assert tolerances.noise_rule(state) == (measured["noise_ratio"], measured["noise_factor"])
    spec = models.ModelSpec(name="measured", make_module=mlp.make_module, loss=mlp.loss,
                            synthetic_batch=mlp.synthetic_batch, init_inputs=lambda b: b["inputs"],
                            cross_mesh_loss_rtol=loss, cross_mesh_state_rtol=state,
                            init_tolerances=lambda config: models.load_tolerances(str(out), from_init=True))
    assert spec.tolerances_of(None) == (loss, state) and spec.init_tolerances_of(None) == (init_loss, init_state)
    assert mlp.SPEC.init_tolerances_of(None) == mlp.SPEC.tolerances_of(None), "a spec without them: as before"


@pytest.mark.slow
@pytest.mark.parametrize("flags, line", [
    (("--model=nope",), "--model=nope: not a built-in model"),
    (("--meshes=data=8",), "--meshes='data=8': give two or more meshes"),
    (("--meshes=data=4,model=2;data=16",), "--mesh=data=16 has 16 devices but 8 are visible"),
    (("--windows=0,2",), "--windows='0,2': every window must be at least 1 step"),
    (("--mesh=data=8",), "--mesh: give the layouts with --meshes"),
    (("--steps=0",), "--steps must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, line):
    result = helpers.run_module("verifier.calibrate", *flags, f"--out={tmp_path / 'x.json'}", timeout=60)
    assert result.returncode == 2 and line in result.stderr, result.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_spec_that_cannot_be_proved_across_layouts_says_so(tmp_path):
    path = tmp_path / "tolerances.json"
    path.write_text(json.dumps({"provable_across_layouts": False, "reason": "prove it on its recording layout"}))
    with pytest.raises(models.ConfigError, match="recording layout"):
        models.load_tolerances(str(path))


def _row(steps, state, init_state, *, loss=1e-7, init_loss=1e-6, signal=0.5):
    """One per_window row of verifier.drift as calibrate writes it."""
    return {"steps": steps, "loss_drift": loss, "state_drift": state, "noise_drift": 0.5,
            "init_loss_drift": init_loss, "init_state_drift": init_state,
            "loss_signal": dict.fromkeys(drift.BROKEN, 5e-2), "state_signal": dict.fromkeys(drift.BROKEN, signal),
            "loss_margin": 5e-2 / loss, "state_margin": signal / state, "state_drift_leaf": ".params['Dense_0']"}


def test_the_drift_from_the_init_gets_its_own_tolerance_and_leaves_the_ordinary_one_alone(tmp_path):
    # The wide mlp's shape: from a saved step ~1.5e-7 at every window, from the init 6.6e-6 then 2.4e-3.
    rows = [_row(4, 1.5e-7, 6.6e-6), _row(16, 1.4e-7, 2.4e-3, init_loss=3e-5)]
    derived = drift.derive(rows, 10.0, 10.0, tolerances.NOISE_RATIO)
    assert [derived[k] for k in ("cross_mesh_loss_rtol", "cross_mesh_state_rtol", "cross_mesh_init_loss_rtol",
                                 "cross_mesh_init_state_rtol")] == pytest.approx([1e-6, 1.5e-6, 3e-4, 2.4e-2])
    assert derived["provable_across_layouts"] and derived["first_interval_provable_across_layouts"]
    path = tmp_path / "tolerances.json"
    path.write_text(json.dumps(derived))
    assert models.load_tolerances(str(path)) == pytest.approx((1e-6, 1.5e-6))
    loss, state = models.load_tolerances(str(path), from_init=True)
    assert (loss, state) == pytest.approx((3e-4, 2.4e-2))
    assert tolerances.noise_rule(state) == (tolerances.NOISE_RATIO, tolerances.NOISE_FACTOR)
    # A from-init drift below the saved step's never makes the first interval stricter than the others.
    calm = drift.derive([_row(4, 2e-7, 1e-7, init_loss=1e-8)], 10.0, 10.0, tolerances.NOISE_RATIO)
    assert (calm["cross_mesh_init_loss_rtol"], calm["cross_mesh_init_state_rtol"]) == (
        calm["cross_mesh_loss_rtol"], calm["cross_mesh_state_rtol"])


def test_a_first_interval_too_close_to_the_broken_signals_keeps_the_ordinary_tolerance(tmp_path):
    # The bfloat16 transformer's shape: from the init it drifts a good part of the broken signal.
    derived = drift.derive([_row(1, 6e-3, 0.35, signal=0.65)], 10.0, 10.0, 3e-3)
    assert derived["provable_across_layouts"] and not derived["first_interval_provable_across_layouts"]
    assert "prove its first interval on its recording layout" in derived["init_reason"]
    assert "its first interval (from the init) is NOT provable" in drift.table([_row(1, 6e-3, 0.35)], derived)
    path = tmp_path / "tolerances.json"
    path.write_text(json.dumps(derived))
    assert models.load_tolerances(str(path), from_init=True) == models.load_tolerances(str(path))


def test_a_file_from_before_the_from_init_pair_gives_its_one_pair_for_both(tmp_path):
    path = tmp_path / "tolerances.json"
    path.write_text(json.dumps({"provable_across_layouts": True, "cross_mesh_loss_rtol": 1e-5,
                                "cross_mesh_state_rtol": 2e-5, "noise_ratio": 1e-5, "noise_factor": 4.0}))
    assert models.load_tolerances(str(path), from_init=True) == models.load_tolerances(str(path)) == (1e-5, 2e-5)


GOOD = {"provable_across_layouts": True, "cross_mesh_loss_rtol": 1e-6, "cross_mesh_state_rtol": 1.5e-6,
        "cross_mesh_init_loss_rtol": 3e-4, "cross_mesh_init_state_rtol": 2.4e-2, "noise_ratio": 1e-5,
        "noise_factor": 4.0}


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it (No such file or directory)"),
    ("{not json", "not a JSON file written by python -m verifier.calibrate"),
    ("[1, 2]", "not a JSON object written by python -m verifier.calibrate"),
    ("{}", "no provable_across_layouts"),
    (json.dumps({**GOOD, "cross_mesh_state_rtol": None}), "cross_mesh_state_rtol must be a finite number >= 0"),
    (json.dumps({**GOOD, "cross_mesh_init_state_rtol": -1.0}), "cross_mesh_init_state_rtol must be a finite number"),
    (json.dumps({**GOOD, "cross_mesh_init_loss_rtol": float("nan")}), "cross_mesh_init_loss_rtol must be a finite"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "noise_factor"}), "noise_factor must be a finite number"),
])
def test_a_missing_or_garbled_file_is_one_line_naming_it(tmp_path, content, says):
    path = tmp_path / "tolerances.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(models.ConfigError) as raised:
        models.load_tolerances(str(path), from_init=True)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message, message


def test_a_plain_float_rtol_keeps_the_verifiers_noise_rule():
    assert tolerances.noise_rule(1e-4) == (tolerances.NOISE_RATIO, tolerances.NOISE_FACTOR)
    assert tolerances.noise_rule(models.StateTolerance(0.2, noise_ratio=3e-3)) == (3e-3, tolerances.NOISE_FACTOR)


def _state_mismatch(replayed, recorded, anchor, leaves, rtol):
    """The verifier's cross-layout state comparison (verifier/proofs.py's), on host trees."""
    like = jax.tree.structure(anchor)
    replayed, recorded = (jax.tree.unflatten(like, jax.tree.leaves(t)) for t in (replayed, recorded))
    return compare.compare_leaves(replayed, recorded, tolerances.state_tolerances(replayed, anchor, rtol, leaves))


@pytest.mark.slow
def test_bf16_transformer_genuine_steps_pass_across_layouts_and_broken_resumes_fail(tmp_path):
    """Saved on data=4,model=2 after 5 steps, 10 steps replayed on data=8 (a save interval): the
    genuine replay passes the spec's bfloat16 rule; each of seed 003's broken resumes fails it."""
    config = helpers.small_config(str(tmp_path), model="transformer", compute_dtype="bfloat16")
    recording, verifying = drift.program_on(config, helpers.MESHES["data=4,model=2"]), \
        drift.program_on(config, helpers.MESHES["data=8"])
    rtol = verifying.state_rtol
    assert tolerances.noise_rule(rtol)[0] > tolerances.NOISE_RATIO, "bfloat16 carries its own noise rule"
    state = recording.init_fn()
    for step in range(5):
        state, _ = recording.step_fn(state, recording.batch_fn(step))
    anchor, leaves = jax.device_get(state), drift.leaf_table(recording.abstract_state)
    replayed = drift.trajectory(verifying, anchor, 5, [10])[0][10]
    genuine = drift.trajectory(recording, anchor, 5, [10])[0][10]
    assert _state_mismatch(replayed, genuine, anchor, leaves, rtol) is None
    # The float32-calibrated noise rule mistakes the key biases' bfloat16 rounding noise for a signal.
    plain = _state_mismatch(replayed, genuine, anchor, leaves, float(rtol))
    assert plain is not None and "['key']['bias']" in plain.where, plain
    failing = {}
    for kind, (start, first) in drift.broken_starts(anchor).items():
        recorded = drift.trajectory(recording, start, 5 if first is None else first, [10])[0][10]
        mismatch = _state_mismatch(replayed, recorded, anchor, leaves, rtol)
        failing[kind] = mismatch is not None and mismatch.kind == "leaf"
    assert failing == dict.fromkeys(drift.BROKEN, True)
