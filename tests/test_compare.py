"""Fast unit tests: every comparison a proof rests on fails on NaN and Inf (manifests: test_manifest.py)."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing._src import compare


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("rtol", [0.0, 1e-5])
def test_a_non_finite_loss_on_either_side_is_a_mismatch(bad, rtol):
    expected = {10: 1.0, 11: 0.5}
    mismatch, _ = compare.compare_losses({10: 1.0, 11: bad}, expected, rtol)
    assert mismatch is not None and mismatch.where == 11 and "step 11" in mismatch.detail
    mismatch, _ = compare.compare_losses({10: 1.0, 11: 0.5}, {10: 1.0, 11: bad}, rtol)
    assert mismatch is not None and mismatch.where == 11


def test_loss_lists_compare_every_step_not_the_first():
    mismatch, largest = compare.compare_losses({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.0, 1: 2.0, 2: 3.0 * (1 + 1e-3)}, 1e-5)
    assert mismatch.where == 2 and largest == pytest.approx(1e-3, rel=1e-3)
    assert compare.compare_losses({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0}, 0.0) == (None, 0.0)
    assert compare.compare_losses({0: 1.0}, {0: 1.0, 1: 2.0}, 1e-5)[0].where == 1, "a missing step is a mismatch"


def test_bit_exact_means_equal_not_close():
    assert compare.compare_losses({0: 1.0}, {0: 1.0 + 1e-15}, 0.0)[0] is not None


def test_within_fails_on_nan():
    assert compare.within(0.0, 0.0) and not compare.within(math.nan, 1.0) and not compare.within(math.inf, math.inf)


def test_leaves_compare_by_path_with_their_own_tolerance_and_nan_fails():
    expected = {"a": jnp.ones(4), "b": jnp.zeros(3)}
    actual = {"a": jnp.ones(4) * (1 + 1e-6), "b": jnp.zeros(3)}
    assert compare.compare_leaves(actual, expected, {"['a']": 1e-5, "['b']": 0.0}) is None
    mismatch = compare.compare_leaves(actual, expected, {"['a']": 1e-7, "['b']": 0.0})
    assert mismatch.where == "['a']"
    poisoned = {"a": jnp.ones(4), "b": jnp.array([0.0, jnp.nan, 0.0])}
    mismatch = compare.compare_leaves(poisoned, expected, {"['a']": 1.0, "['b']": 1e30})
    assert mismatch.where == "['b']" and "NaN" in mismatch.detail
    assert compare.nonfinite_leaves(poisoned) == ["['b']"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nonfinite_leaves_names_each_leaf_with_a_nan_or_inf_on_any_sharding(bad, dtype):
    mesh = jax.make_mesh((8,), ("data",))
    values = jnp.full((64, 8), jnp.finfo(dtype).max, dtype)  # the largest finite values stay finite
    poisoned = jax.device_put(values.at[37, 5].set(bad), NamedSharding(mesh, P("data")))
    tree = {"big": values, "bad": poisoned, "step": jnp.int32(3)}
    assert compare.nonfinite_leaves(tree) == ["['bad']"]
    assert compare.nonfinite_leaves({"step": jnp.int32(3)}) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_norm_of_a_leaf_holding_nan_or_inf_is_not_finite_and_of_zeros_is_zero(bad):
    assert not math.isfinite(float(compare.norm(jnp.array([0.0, bad, 2.0]))))
    assert not math.isfinite(float(compare.norm(jnp.array([bad, 0.0]))))
    assert float(compare.norm(jnp.zeros(5))) == 0.0
    tiny = jnp.full((4,), 1e-20, jnp.float32)  # the squares underflow float32; the scaled norm does not
    assert float(compare.norm(tiny)) == pytest.approx(2e-20, rel=1e-6)
