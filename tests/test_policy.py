"""The save decision in-process: the Young/Daly interval, its bounds, M from history, C from steps."""

import math

import pytest

from checkpointing._src.policy import (AutoInterval, SavePolicy, mean_time_between_interruptions, p90,
                                       young_daly_interval)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_young_daly_is_sqrt_2cm_inside_its_bounds():
    # C = 2 s, M = 3600 s: sqrt(2 * 2 * 3600) = 120 s; the overhead bound (2 / 0.02 = 100 s) is below it.
    assert young_daly_interval(2.0, 3600.0, step_secs=0.1, max_overhead=0.02, max_interval_secs=1e9) == 120.0


def test_max_save_overhead_raises_the_interval():
    # C = 5 s, M = 600 s: sqrt(6000) = 77 s, but 5 / 0.02 = 250 s keeps saves at 2% of the time.
    assert young_daly_interval(5.0, 600.0, step_secs=0.1, max_overhead=0.02, max_interval_secs=1e9) == 250.0


def test_max_interval_caps_everything():
    assert young_daly_interval(5.0, 1e7, step_secs=0.1, max_overhead=0.02, max_interval_secs=900.0) == 900.0


def test_mtbi_prior_before_any_interruption_then_history():
    assert mean_time_between_interruptions(0, 0.0, 3600.0) == 3600.0
    assert mean_time_between_interruptions(0, 7200.0, 3600.0) == 10800.0  # none seen in 2 h: at least that long
    # 9 interruptions in 10 h: M approaches history / count, the prior weighs as one more.
    assert mean_time_between_interruptions(9, 36000.0 - 3600.0, 3600.0) == 3600.0


def test_p90_of_recent_commits():
    assert p90([]) is None
    assert p90([1.0]) == 1.0
    assert p90([float(x) for x in range(1, 11)]) == 10.0  # nearest rank: the slowest of ten
    assert p90([float(x) for x in range(1, 21)]) == 19.0


def test_auto_cost_is_blocking_plus_slowdown_and_sets_the_interval():
    auto = AutoInterval(mtbi_secs=3600.0, max_overhead=0.02, max_interval_secs=1e9)
    assert auto.interval() == AutoInterval.FIRST_INTERVAL_SECS  # nothing measured: save soon to measure C
    for _ in range(20):
        auto.step(0.1, writing=False)  # baseline step 0.1 s
    auto.save_started(0.5)  # the save blocked 0.5 s
    for _ in range(10):
        auto.step(0.25, writing=True)  # 0.15 s slower per step while the write runs: 1.5 s
    auto.committed()
    assert math.isclose(auto.cost_secs, 2.0)
    assert math.isclose(auto.interval(), 120.0)  # sqrt(2 * 2 * 3600)
    auto.save_started(0.5)  # a cheap second save (no slow-down) halves the way to its cost
    auto.committed()
    assert math.isclose(auto.cost_secs, 1.25)
    assert math.isclose(auto.interval(), math.sqrt(2 * 1.25 * 3600))


def test_policy_saves_on_the_auto_interval_with_an_injected_clock():
    clock = FakeClock()
    auto = AutoInterval(mtbi_secs=3600.0, max_overhead=0.02, max_interval_secs=1e9, cost_secs=2.0)
    policy = SavePolicy(0, auto.interval(), clock=clock)
    clock.now = 119.0
    assert policy.reason(7) is None
    clock.now = 120.0
    assert policy.reason(8) == "time"
    policy.saved()
    clock.now = 200.0
    assert policy.reason(9) is None


def test_time_saves_land_on_time_after_a_few_checks_per_interval():
    # Each check is a broadcast on a multi-process pod: about half the time left (at most
    # MAX_CHECK_GAP_SECS) passes between checks, so an interval costs a few, not one per step.
    clock = FakeClock()
    checks = []
    policy = SavePolicy(0, 100.0, clock=lambda: checks.append(clock.now) or clock.now)
    saves = []
    for step in range(1, 251):
        clock.now = float(step)  # one second a step
        if policy.reason(step) == "time":
            saves.append(step)
            policy.saved()
    assert saves == [100, 200]
    assert len(checks) < 250 / 5, checks
    assert all(b - a <= SavePolicy.MAX_CHECK_GAP_SECS for a, b in zip(checks, checks[1:])), checks


@pytest.mark.parametrize("cost, mtbi", [(float("nan"), 3600.0), (2.0, float("nan"))])
def test_nan_inputs_never_disable_saving(cost, mtbi):
    # A NaN interval would make `elapsed >= interval` always false: never save. The bound must win.
    interval = young_daly_interval(cost, mtbi, step_secs=0.1, max_overhead=0.02, max_interval_secs=900.0)
    assert interval <= 900.0


def test_save_policy_reasons_with_an_injected_clock():
    now = [0.0]
    policy = SavePolicy(save_every_steps=10, save_every_secs=30, clock=lambda: now[0])
    assert policy.reason(3) is None
    assert policy.reason(10) == "interval"
    assert policy.reason(11, preempted=True) == "preemption"
    assert policy.reason(12, final=True) == "final"
    now[0] = 31.0
    assert policy.reason(13) == "time"
    policy.saved()
    assert policy.reason(14) is None
    assert SavePolicy(save_every_steps=0).reason(10) is None
