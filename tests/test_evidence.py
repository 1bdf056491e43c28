"""The rule a cross-layout verdict rests on (verifier/evidence.py), on numbers: a record fails only beyond MARGIN
times the spread the replays measured; a leaf whose spread is as wide as its scale is judged against that spread
(never skipped) but never decides alone; a proof where nothing can decide is inconclusive; integers are exact;
NaN never passes."""

import math

from verifier import evidence
from verifier.evidence import MARGIN, LeafNumbers


def leaf(distance, noise, norm=1.0, moved=0.5, finite=2, is_float=True) -> LeafNumbers:
    return LeafNumbers(distance=distance, noise=noise, norm=norm, moved=moved, finite_replays=finite, replays=2,
                       is_float=is_float, eps=1.2e-7 if is_float else 0.0)


def test_a_record_within_the_margin_of_the_measured_noise_passes_and_one_beyond_it_fails():
    near = evidence.judge_leaves({".params['w']": leaf(distance=MARGIN / 2 * 1e-6, noise=1e-6)})
    assert near.status == "pass" and abs(near.largest - MARGIN / 2) < 1e-9 and near.deciding == 1
    far = evidence.judge_leaves({".params['w']": leaf(distance=(MARGIN + 1) * 1e-6, noise=1e-6)})
    assert far.status == "fail" and far.findings[0].where == ".params['w']"
    assert f"{MARGIN + 1:.3g}x the spread of the replays measured here" in far.findings[0].detail


def test_replays_that_agree_bit_for_bit_leave_a_floor_of_a_few_ulps_not_zero():
    ulps = evidence.FLOOR_ULPS * 1.2e-7  # of the leaf's scale (its norm, 1.0)
    assert evidence.judge_leaves({"w": leaf(distance=10 * ulps, noise=0.0)}).status == "pass"
    assert evidence.judge_leaves({"w": leaf(distance=2 * MARGIN * ulps, noise=0.0)}).status == "fail"


def test_a_chaotic_leaf_is_judged_against_its_wide_spread_and_decides_nothing_alone():
    chaotic = leaf(distance=0.9, noise=0.5)  # a zero-gradient bias: its spread is half its scale
    found = evidence.judge_leaves({".params['bias']": chaotic, ".params['w']": leaf(distance=1e-6, noise=1e-6)})
    assert found.status == "pass" and found.chaotic == [".params['bias']"] and found.deciding == 1
    only = evidence.judge_leaves({".params['bias']": chaotic})
    assert only.status == "inconclusive", "nothing could decide: not a pass"
    broken = evidence.judge_leaves({".params['bias']": chaotic, ".params['w']": leaf(distance=0.3, noise=1e-6)})
    assert broken.status == "fail" and broken.findings[0].where == ".params['w']"


def test_a_running_mean_moved_far_beyond_its_spread_fails_though_its_spread_is_wide():
    """A BatchNorm mean moved by +3.0 on 64 elements (norm 24) where genuine replays spread by 0.2: a wide bound,
    never none."""
    moved = leaf(distance=24.0, noise=0.2, norm=0.5, moved=0.3)
    found = evidence.judge_leaves({"['batch_stats']['mean']": moved, "w": leaf(distance=1e-6, noise=1e-6)})
    assert found.status == "fail" and found.findings[0].where == "['batch_stats']['mean']"
    assert found.chaotic == ["['batch_stats']['mean']"]


def test_a_bound_as_large_as_the_values_cannot_decide():
    loud = evidence.judge_leaves({"w": leaf(distance=0.05, noise=1.0 / MARGIN, norm=1.0)})  # MARGIN x spread >= 1
    assert loud.status == "inconclusive" and loud.findings == []


def test_integer_leaves_are_exact_and_nan_never_passes():
    assert evidence.judge_leaves({".step": leaf(1.0, 0.0, is_float=False)}).status == "fail"
    assert evidence.judge_leaves({"w": leaf(math.nan, 1e-6)}).status == "fail"
    assert evidence.judge_leaves({"w": leaf(0.1, 1e-6, finite=0)}).status == "fail", "every replay diverged"
    disagreeing = evidence.judge_leaves({"w": leaf(0.1, math.nan, finite=1), "v": leaf(1e-7, 1e-7)})
    assert disagreeing.status == "pass" and disagreeing.chaotic == ["w"], "replays that disagree measure nothing"


def test_losses_pool_their_noise_over_the_interval_and_blame_the_first_step_beyond_it():
    replay_here = {0: 1.0, 1: 0.5, 2: 0.25}
    other = {0: 1.0 + 1e-6, 1: 0.5, 2: 0.25}  # one step's difference: 1e-6 relative, pooled over the interval
    genuine = {0: 1.0 + 3e-6, 1: 0.5 * (1 + MARGIN / 2 * 1e-6), 2: 0.25}
    assert evidence.judge_losses(genuine, [replay_here, other]).status == "pass"
    broken = {0: 1.0, 1: 0.5 * (1 + 2 * MARGIN * 1e-6), 2: 0.3}
    found = evidence.judge_losses(broken, [replay_here, other])
    assert found.status == "fail" and [f.where for f in found.findings] == [1], "the first step, not the loudest"
    assert evidence.judge_losses({0: math.nan}, [{0: 1.0}, {0: 1.0}]).status == "fail"


def test_a_declared_bound_is_a_floor_never_the_rule():
    replays = [{0: 1.0}, {0: 1.0 + 1e-7}]
    floor = evidence.FLOOR_ULPS * evidence.FLOAT32_EPS  # the noise, 1e-7, is below the ulp floor
    assert evidence.judge_losses({0: 1.0 + MARGIN / 2 * floor}, replays).status == "pass"
    strict = evidence.judge_losses({0: 1.0 + 5e-4}, replays)
    assert strict.status == "fail"
    assert evidence.judge_losses({0: 1.0 + 5e-4}, replays, floor_rtol=1e-3).status == "pass", "declared looser"


def test_probe_sums_and_norms_against_the_replays_noise():
    replays = [{"w": [10.0, 3.0]}, {"w": [10.0 + 1e-5, 3.0 + 1e-6]}]
    sizes, integer = {"w": 100}, set()
    near = {"w": [10.0 + MARGIN / 2 * 1e-5, 3.0 + MARGIN / 2 * 1e-6]}
    assert evidence.judge_summaries(near, replays, sizes, integer, 14).status == "pass"
    flipped = evidence.judge_summaries({"w": [-10.0, 3.0]}, replays, sizes, integer, 14)
    assert flipped.status == "fail" and flipped.findings[0].kind == "sum"
    counter = evidence.judge_summaries({".step": [13.0, 13.0]}, [{".step": [14.0, 14.0]}] * 2, {".step": 1},
                                       {".step"}, 14)
    assert counter.status == "fail"
