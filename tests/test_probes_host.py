"""Probe summaries taken on the host (checkpointing/_src/probes.py host_summaries): where the state already lies in
host memory, process 0 sums its own shards with NumPy instead of compiling and running a device pass.
Compared leaf by leaf with float64 sums of the whole array and with the device pass; NaN and Inf stay
non-finite; which layouts process 0 holds whole is decided from the shardings alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from checkpointing._src import probes
from checkpointing.errors import ManifestError

MESHES = {"data=8": ((8, 1), ("data", "model")), "model=8": ((1, 8), ("data", "model")),
          "data=4,model=2": ((4, 2), ("data", "model"))}
SPECS = {"w": P("data", "model"), "cols": P(None, "model"), "rows": P("data"), "bias": P(), "step": P()}


def global_state() -> dict:
    w = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7.0 - 40.0
    return {"w": w, "cols": w * 1e-20, "rows": w.astype(jnp.bfloat16), "bias": jnp.linspace(-3.0, 5.0, 16),
            "step": jnp.int32(12)}


def on_mesh(name: str, state: dict | None = None) -> dict:
    mesh = jax.make_mesh(*MESHES[name], axis_types=(AxisType.Auto, AxisType.Auto))
    return {path: jax.device_put(x, NamedSharding(mesh, SPECS[path])) for path, x in (state or global_state()).items()}


def reference(x) -> list[float]:
    values = np.asarray(x).astype(np.float64).reshape(-1)
    return [math.fsum(values), math.sqrt(math.fsum(values * values))]


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_each_leaf_is_its_float64_sum_and_norm_and_the_device_pass_up_to_float32_rounding(mesh):
    state = on_mesh(mesh)
    assert probes.host_held(state), "one process on CPU devices holds every leaf whole"
    host, device = probes.host_summaries(state), probes.to_host(probes.leaf_summaries(state))
    assert sorted(host) == sorted(device) == [f"['{path}']" for path in sorted(SPECS)]
    for path, x in global_state().items():
        key = f"['{path}']"
        np.testing.assert_allclose(host[key], reference(x), rtol=1e-12, err_msg=key)
        np.testing.assert_allclose(host[key], device[key], rtol=1e-6, err_msg=key)
    assert host["['cols']"][1] > 0.0, "values near 1e-19 keep a norm: their squares do not underflow float64"
    assert host["['step']"] == [12.0, 12.0]


def test_a_layout_gives_the_same_numbers_every_time_and_other_layouts_differ_only_by_float64_rounding():
    first = probes.host_summaries(on_mesh("data=4,model=2"))
    assert probes.host_summaries(on_mesh("data=4,model=2")) == first
    for other in ("data=8", "model=8"):
        summaries = probes.host_summaries(on_mesh(other))
        for path, value in first.items():
            np.testing.assert_allclose(summaries[path], value, rtol=1e-13, err_msg=f"{other} {path}")


def test_the_numbers_are_float64_sums_of_each_piece_in_order_bit_for_bit_whatever_the_dtype():
    """Recorded probes are compared for equality on the same layout, so the summing itself may not change: per
    shard in index order, pieces of probes._CHUNK elements, each converted to float64 and summed (pairwise) and
    its squares summed (einsum), the pieces' results added in order. Leaves span several pieces and a short
    last one, in every dtype the state may hold."""
    rng = np.random.default_rng(7)
    size = 2 * probes._CHUNK + 123
    leaves = {"f32": rng.standard_normal(size).astype(np.float32) * 1e3,
              "bf16": jnp.asarray(rng.standard_normal(size), jnp.bfloat16),
              "i32": rng.integers(-1 << 30, 1 << 30, size).astype(np.int32),
              "u32": rng.integers(0, 1 << 32, size, dtype=np.uint32),
              "bool": rng.integers(0, 2, size).astype(bool)}
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    state = {path: jax.device_put(jnp.asarray(x), NamedSharding(mesh, P())) for path, x in leaves.items()}
    summaries = probes.host_summaries(state)
    for path, x in leaves.items():
        values = np.asarray(x).reshape(-1)
        total = squares = 0.0
        for start in range(0, size, probes._CHUNK):
            piece = values[start:start + probes._CHUNK].astype(np.float64)
            total += float(piece.sum())
            squares += float(np.einsum("i,i->", piece, piece))
        assert summaries[f"['{path}']"] == [total, math.sqrt(squares)], path


@pytest.mark.parametrize("bad, expected", [(jnp.nan, (math.isnan, math.isnan)), (jnp.inf, (math.isinf, math.isinf)),
                                           (-jnp.inf, (math.isinf, math.isinf))])
def test_a_non_finite_element_makes_its_leafs_sum_and_norm_non_finite(bad, expected):
    state = global_state()
    state["w"] = state["w"].at[5, 3].set(bad)
    state = on_mesh("data=4,model=2", state)
    summary = probes.host_summaries(state)["['w']"]
    assert expected[0](summary[0]) and expected[1](summary[1]), summary
    assert all(math.isfinite(v) for v in probes.host_summaries(state)["['bias']"])


class Device:
    """A device of a sharding's global map, as covers() reads it: only its process (hashed by identity)."""

    def __init__(self, process_index: int):
        self.process_index = process_index


def test_process_zero_holds_a_leaf_whole_only_when_its_own_devices_shards_cover_it():
    """covers(): the decision every process takes from a sharding's global device -> index map. Data
    parallelism over processes (each holds a replica) is covered, and so is a leaf split over process 0's
    own devices; a leaf split across processes is not."""
    shape, whole = (4, 6), (slice(None), slice(None))
    top, bottom = (slice(0, 2), slice(None)), (slice(2, 4), slice(None))
    assert probes.covers({Device(0): whole, Device(1): whole}, shape, process=0)
    assert probes.covers({Device(0): top, Device(0): bottom, Device(1): top, Device(1): bottom}, shape, process=0)
    assert probes.covers({Device(0): top, Device(0): top, Device(0): bottom}, shape, process=0), "replicas count once"
    assert not probes.covers({Device(0): top, Device(1): bottom}, shape, process=0)
    assert not probes.covers({Device(1): whole}, shape, process=0)


def test_a_probe_names_how_its_summaries_were_computed_and_nothing_else():
    probe = probes.make(step=10, manifest_digest="d", losses={10: 1.0, 11: 2.0}, summary_step=12,
                        summaries={"['w']": [1.0, 2.0]}, mesh={"data": 2}, process_count=2,
                        summary_pass=probes.HOST_PASS)
    assert probes.validate(dict(probe))["summary_pass"] == "host"
    with pytest.raises(ManifestError, match="summary_pass"):
        probes.validate({**probe, "summary_pass": "elsewhere"})
