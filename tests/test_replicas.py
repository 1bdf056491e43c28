"""Checks read each leaf once, not once per replica (checkpointing/_src/replicas.py): the same values, a quarter
of the work per device on data=4,model=2, and no data moved between devices to get there."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from checkpointing._src import compare, replicas
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marks as marks_lib


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _spec(mesh, spec, shape):
    spread = replicas.spread(NamedSharding(mesh, spec), shape)
    return None if spread is None else spread.spec


def test_a_replicated_leaf_is_split_over_its_replicas_after_the_axes_that_split_it(mesh):
    assert _spec(mesh, P(None, "model"), (8, 6)) == P("data", "model")  # the larger blocks: dim 0
    assert _spec(mesh, P(None, "model"), (6, 8)) == P(None, ("model", "data"))  # after 'model': a local slice
    assert _spec(mesh, P(), (16,)) == P(("data", "model"))
    assert _spec(mesh, P(), (4, 3)) == P("data", None)  # 'model' divides neither dimension left
    assert _spec(mesh, P(), (3,)) is None  # nothing divides: the check's program is as before
    assert _spec(mesh, P(), ()) is None
    assert _spec(mesh, P("data", "model"), (8, 8)) is None  # not replicated


def test_an_axis_across_processes_is_never_used():
    processes = np.array([[0, 0], [1, 1]])  # axis 0 goes from process 0 to process 1
    assert not replicas.axis_within_processes(processes, 0)
    assert replicas.axis_within_processes(processes, 1)
    assert replicas.axis_within_processes(np.zeros((4, 2), np.int64), 0)


def _state(mesh):
    rng = np.random.default_rng(0)
    values = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal((32,)).astype(np.float32),
              "h": rng.standard_normal((24, 16)).astype(ml_dtypes.bfloat16), "odd": np.arange(15, dtype=np.int32),
              "step": np.int32(7)}
    specs = {"w": P(None, "model"), "b": P("model"), "h": P(), "odd": P(), "step": P()}
    return values, {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in values.items()}


def test_fingerprints_of_a_replicated_state_equal_one_devices_for_every_leaf(mesh):
    values, state = _state(mesh)
    one_device = {k: jax.device_put(v, jax.devices()[0]) for k, v in values.items()}
    on_one_device = fingerprint_lib.fingerprint_tree(one_device)
    assert fingerprint_lib.fingerprint_tree(state) == on_one_device
    shardings = jax.tree.map(lambda x: x.sharding, state)
    marks = marks_lib.fingerprint_ints(marks_lib.marks_fn(shardings).fingerprints(state), marks_lib.leaf_paths(state))
    assert marks == on_one_device
    assert len(on_one_device) == 5


def test_the_pass_does_a_quarter_of_the_work_per_device_and_moves_no_data(mesh):
    _, state = _state(mesh)
    leaves = jax.tree.leaves(state)
    spread = fingerprint_lib._fingerprint_fn(mesh).lower(state, replicas.spreads(leaves)).compile()
    as_before = fingerprint_lib._fingerprint_fn(mesh).lower(state, (None,) * len(leaves)).compile()

    def flops(compiled):
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(spread) <= 0.3 * flops(as_before), (flops(spread), flops(as_before))
    program = spread.as_text()
    assert "all-to-all" not in program and "collective-permute" not in program  # slices of what each device holds


CASES = [(dtype, bad) for dtype in (np.float32, ml_dtypes.bfloat16, np.float16) for bad in (np.nan, np.inf, -np.inf)]
CASES.append((ml_dtypes.float8_e4m3fn, np.nan))  # no Inf in that format: the x * 0 way


@pytest.mark.parametrize("dtype,bad", CASES)
def test_nonfinite_leaves_finds_a_value_in_any_replicas_slice(mesh, dtype, bad):
    sharding = NamedSharding(mesh, P(None, "model"))
    for where in [(0, 0), (63, 31), (17, 5)]:  # slices of different devices after the spread
        values = np.ones((64, 32), dtype)
        values[where] = bad
        tree = {"bad": jax.device_put(values, sharding),
                "good": jax.device_put(np.full((64, 32), jnp.finfo(dtype).max, dtype), sharding),
                "empty": jax.device_put(np.zeros((0, 4), dtype), NamedSharding(mesh, P())),
                "count": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
        assert compare.nonfinite_leaves(tree) == ["['bad']"], (dtype, bad, where)


def test_the_largest_finite_values_are_finite(mesh):
    tree = {str(np.dtype(d)): jax.device_put(np.array([jnp.finfo(d).max, jnp.finfo(d).min, jnp.finfo(d).tiny], d),
                                            NamedSharding(mesh, P()))
            for d in (np.float32, ml_dtypes.bfloat16, np.float16)}
    assert compare.nonfinite_leaves(tree) == []
