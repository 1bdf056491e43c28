"""benchmarks/verifier_pace.py: the verifier's pace from the commits' and complete verdicts' times (pure, fast)."""

import pytest

from benchmarks.verifier_pace import ratios, verifier_pace


def _verdict(at: float, replayed: int) -> tuple[float, dict]:
    return at, {"replayed_steps": replayed}


def test_pace_runs_to_the_final_steps_complete_verdict():
    commits = {40: 10.0, 80: 20.0}
    complete = {40: _verdict(12.0, 40), 80: _verdict(25.0, 40)}
    pace = verifier_pace(commits, complete, train_steps_per_sec=4.0)
    assert pace["proved_steps_per_sec"] == [pytest.approx(40 / 15)]
    assert pace["replayed_steps_per_sec"] == [pytest.approx(80 / 15)]
    assert pace["final_lag_secs"] == [pytest.approx(5.0)]
    assert pace["replayed_over_trained"] == [pytest.approx(1.0)]
    assert pace["unverified_steps"] == [[]]


def test_a_final_step_without_a_complete_verdict_is_paced_to_the_newest_one_that_had_one():
    # The device benchmark's verifier part crashed here (KeyError: 200) when the grace period ended first.
    commits = {40: 10.0, 80: 20.0, 120: 30.0, 160: 40.0, 200: 50.0}
    complete = {40: _verdict(15.0, 40), 80: _verdict(40.0, 40), 120: _verdict(70.0, 40)}
    pace = verifier_pace(commits, complete, train_steps_per_sec=4.0)
    assert pace["proved_steps_per_sec"] == [pytest.approx(80 / 60)]
    assert pace["final_lag_secs"] == []
    assert pace["unverified_steps"] == [[160, 200]]
    assert {k: v[0] for k, v in pace.items() if v}["unverified_steps"] == [160, 200]  # device_bench's reading


def test_no_complete_verdict_at_all_measures_no_pace():
    pace = verifier_pace({40: 10.0, 80: 20.0}, {}, train_steps_per_sec=4.0)
    assert pace["proved_steps_per_sec"] == [] and pace["unverified_steps"] == [[40, 80]]


def test_ratios_leave_out_what_no_run_measured():
    run = {"latency": [1.0], "complete_latency": [2.0], "steps_per_sec": [3.0],
           **verifier_pace({40: 10.0, 80: 20.0}, {40: _verdict(12.0, 40)}, train_steps_per_sec=3.0)}
    out = ratios({"0": [run], None: [{"steps_per_sec": [4.0]}]}, {"times": [1.0]}, ["0"])
    assert out["final_lag_secs_budget_0"] is None
    assert out["proved_steps_per_sec_over_trained_budget_0"] == pytest.approx(0.0)
    assert out["train_with_verifier_over_alone_budget_0"] == pytest.approx(0.75)
