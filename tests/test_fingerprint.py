"""Fingerprints: the same for any layout, different for any flipped bit, moved value or swapped leaf.

In-process: small arrays on the 8 fake CPU devices of conftest. Every layout of every dtype
compiles the fingerprint 17 times a dtype (slow); the fast tier checks the pinned values of every
dtype on one layout, and four layouts of one array.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from checkpointing._src import fingerprint as fingerprint_lib
from tests import helpers

SHAPE = (16, 8)  # divisible by every mesh axis in helpers.MESHES
_GRID = np.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE)
# dtype -> an array whose elements all differ (bool: whose rows all differ).
VALUES = {
    "float32": (_GRID * 0.37 - 3).astype(np.float32),
    "bfloat16": (_GRID * 0.37 - 3).astype(jnp.bfloat16),
    "int32": (_GRID * 7919 - 5000).astype(np.int32),
    "uint8": _GRID.astype(np.uint8),
    "bool": _GRID % 3 == 0,
}
# Manifests already written store these values: a change here makes every saved checkpoint fail
# its fingerprint check. Update them only together with manifest.MANIFEST_FORMAT and a reader
# for the old format.
GOLDEN = {
    "float32": 9759962871887066649,
    "bfloat16": 11323852508711676410,
    "int32": 1097336310874984097,
    "uint8": 14089073972742395579,
    "bool": 6018263308567054749,
}


def fingerprint(x) -> int:
    return fingerprint_lib.fingerprint_tree({"x": x})["['x']"]


def layouts(host: np.ndarray) -> list[jax.Array]:
    """The array on every mesh of helpers.MESHES (split along each axis, and replicated) and on one device."""
    arrays = [jax.device_put(host, jax.devices()[3])]
    for axes in helpers.MESHES.values():
        names = tuple(name for name, _ in axes)
        mesh = jax.make_mesh(tuple(size for _, size in axes), names, axis_types=(AxisType.Auto,) * len(axes))
        specs = [P(*names), P(*reversed(names)), P(None, names[-1]), P()]
        arrays += [jax.device_put(host, NamedSharding(mesh, spec)) for spec in specs]
    return arrays


def on_mesh(host: np.ndarray) -> jax.Array:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    return jax.device_put(host, NamedSharding(mesh, P("data", "model")))


def flip_bit(host: np.ndarray, bit: int) -> np.ndarray:
    changed = host.copy()
    if host.dtype == np.bool_:
        changed[3, 5] = not changed[3, 5]
    else:
        unsigned = changed.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[host.dtype.itemsize])
        unsigned[3, 5] ^= unsigned.dtype.type(1 << (bit % (8 * host.dtype.itemsize)))
    return changed


def moves(host: np.ndarray) -> dict[str, np.ndarray]:
    """The same values (or rows) at other positions."""
    rows = host.copy()
    rows[[0, 1]] = rows[[1, 0]]
    elements = host.copy()
    elements[2, [1, 2]] = elements[2, [2, 1]]
    return {"swapped rows": rows, "swapped elements": elements,
            "transposed": np.ascontiguousarray(host.T).reshape(SHAPE)}


def reference(host: np.ndarray) -> int:
    """The fingerprint's definition in NumPy: fmix32(bits + flat index * 0x9E3779B9), two sums mod 2**32."""
    if host.dtype == np.bool_:
        bits = host.astype(np.uint32)
    else:
        bits = host.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[host.dtype.itemsize]).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = bits.ravel() + np.arange(bits.size, dtype=np.uint32) * np.uint32(0x9E3779B9)
        for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = (h ^ (h >> np.uint32(shift))) * np.uint32(multiplier)
        h ^= h >> np.uint32(16)
        return (int(h.sum(dtype=np.uint32)) << 32) | int((h * h).sum(dtype=np.uint32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", VALUES)
def test_equal_on_every_mesh_and_one_device_and_pinned(dtype):
    host = VALUES[dtype]
    values = {fingerprint(x) for x in layouts(host)}
    assert values == {GOLDEN[dtype]}, "a layout changed the fingerprint, or the fingerprint itself changed"
    assert GOLDEN[dtype] == reference(host)


@pytest.mark.parametrize("dtype", VALUES)
def test_pinned_on_one_layout(dtype):
    assert fingerprint(on_mesh(VALUES[dtype])) == GOLDEN[dtype] == reference(VALUES[dtype])


@pytest.mark.parametrize("dtype", VALUES)
def test_a_flipped_bit_changes_it(dtype):
    host = VALUES[dtype]
    original = fingerprint(on_mesh(host))
    for bit in (0, 7, 15, 31):  # lowest, and the top bit of each element size
        assert fingerprint(on_mesh(flip_bit(host, bit))) != original, f"bit {bit}"


@pytest.mark.parametrize("dtype", VALUES)
def test_a_moved_value_changes_it(dtype):
    original = fingerprint(on_mesh(VALUES[dtype]))
    for name, moved in moves(VALUES[dtype]).items():
        assert not np.array_equal(moved, VALUES[dtype]), name
        assert fingerprint(on_mesh(moved)) != original, name


def test_two_swapped_leaves_change_both():
    a, b = on_mesh(VALUES["float32"]), on_mesh(VALUES["float32"] + 1)
    saved = fingerprint_lib.fingerprint_tree({"mu": a, "nu": b})
    swapped = fingerprint_lib.fingerprint_tree({"mu": b, "nu": a})
    assert saved["['mu']"] != swapped["['mu']"] and saved["['nu']"] != swapped["['nu']"]


def test_the_dtype_is_left_to_the_leaf_table():
    # int32 and float32 with identical bits are the same words: a retyped leaf is refused by the
    # manifest's leaf table (check_tree_matches) before any fingerprint is compared.
    bits = VALUES["int32"]
    assert fingerprint(on_mesh(bits)) == fingerprint(on_mesh(bits.view(np.float32)))


def test_unsupported_dtype_is_refused():
    with pytest.raises(TypeError, match="cannot fingerprint dtype complex64"):
        fingerprint(on_mesh(VALUES["float32"].astype(np.complex64)))


def test_fingerprints_ignore_layout_and_see_every_bit_and_position():
    mesh8 = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    mesh42 = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    host = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    layouts = [jax.device_put(host, NamedSharding(mesh8, P("x"))),
               jax.device_put(host, NamedSharding(mesh8, P(None, "x"))),
               jax.device_put(host, NamedSharding(mesh42, P("b", "a"))),
               jax.device_put(host, NamedSharding(mesh42, P()))]
    values = {fingerprint_lib.fingerprint_tree({"w": x})["['w']"] for x in layouts}
    assert len(values) == 1
    reference = values.pop()
    flipped = host.copy()
    flipped.view(np.uint32)[3, 5] ^= 1  # one bit of one element
    swapped = host.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other positions
    for changed in (flipped, swapped, host.T.copy().reshape(16, 8)):
        changed = jax.device_put(changed, layouts[0].sharding)
        assert fingerprint_lib.fingerprint_tree({"w": changed})["['w']"] != reference
    as_int = fingerprint_lib.fingerprint_tree({"s": jax.device_put(jnp.int32(7), NamedSharding(mesh8, P()))})
    assert as_int != fingerprint_lib.fingerprint_tree({"s": jax.device_put(jnp.int32(8), NamedSharding(mesh8, P()))})

