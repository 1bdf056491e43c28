"""Layout-independent fingerprints: one integer per leaf, equal for any sharding and mesh.

Each element's bits, offset by a multiple of its flat index, go through murmur3's finalizer, and
the mixed words (and their squares) are summed with wrap-around uint32 arithmetic. Addition mod
2**32 is associative and commutative, so however XLA splits the sum across devices (or hosts) the
result is the same; mixing in the index means moving a value to another position (a transpose,
two swapped rows) changes it. The two 32-bit sums make one 64-bit value. Computed on device
inside jit, so taking fingerprints at save time never moves the state to the host.

Cost: one read of the leaf (on an accelerator, one read of its HBM). Both sums are one variadic
reduction fused with the mixing, so no element's word is ever written to memory. (Two separate
`jnp.sum`s materialize the words and, on XLA's CPU backend, run as unfused reduce-windows: about
10x a read.) Manifests store these values: tests/test_fingerprint.py pins them.
"""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpointing._src import replicas

_INDEX_MULTIPLIER = 0x9E3779B9  # odd (golden ratio): index -> offset is a bijection mod 2**32


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def as_uint32(x: jax.Array) -> jax.Array:
    """The raw bits of each element as uint32 (1-, 2- and 4-byte dtypes)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
        raise TypeError(f"cannot fingerprint dtype {x.dtype}: only 1-, 2- and 4-byte elements are supported")
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _add_lanes(a, b):
    return a[0] + b[0], a[1] + b[1]


def leaf_fingerprint(x: jax.Array) -> jax.Array:
    """uint32[2]: the two lanes of one leaf's fingerprint."""
    bits = as_uint32(x)
    return lanes_of(bits, _flat_index(bits.shape))


def lanes_of(bits: jax.Array, index: jax.Array) -> jax.Array:
    """uint32[2]: the lanes of elements `bits` at flat indices `index` (a whole leaf, or one shard of it:
    the lanes of the shards add up to the leaf's, mod 2**32)."""
    # One finalizer per element; moving a value to another index changes its word. The second
    # lane sums the squared words, so the two 32-bit sums are not redundant.
    words = _fmix32(bits + index * jnp.uint32(_INDEX_MULTIPLIER))
    zero = jnp.uint32(0)
    lanes = jax.lax.reduce((words, words * words), (zero, zero), _add_lanes, tuple(range(words.ndim)))
    return jnp.stack(lanes)


# Jitted on its own too, so that inside the tree's jit leaves of one shape and dtype (a parameter
# and its two Adam moments) are traced and lowered once: a restart's first fingerprints (restore,
# first save) cost about half as long; XLA inlines the calls, so the pass and its values are the same.
_leaf_fingerprint = jax.jit(leaf_fingerprint)


def _fingerprints(tree, targets: tuple):
    # Each leaf read once, not once per replica (checkpointing/_src/replicas.py): integer sums, the same values.
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_leaf_fingerprint(replicas.constrained(x, target))
                                        for x, target in zip(leaves, targets, strict=True)])


@functools.lru_cache(maxsize=8)
def _fingerprint_fn(mesh: Mesh | None):
    if mesh is None:  # single-device arrays: computed where they live
        return jax.jit(_fingerprints, static_argnums=1)
    # Replicated outputs, so every process can read every fingerprint without a gather.
    return jax.jit(_fingerprints, static_argnums=1, out_shardings=NamedSharding(mesh, P()))


def tree_fingerprints(tree):
    """A tree of uint32[2] fingerprints, one per leaf; dispatches asynchronously like any jit.

    Every leaf must live on one mesh (the program's; the result is replicated on it) or on one device.
    """
    leaves = jax.tree.leaves(tree)
    return _fingerprint_fn(getattr(leaves[0].sharding, "mesh", None))(tree, replicas.spreads(leaves))


def compile_pass(abstract_tree) -> None:
    """Compiles tree_fingerprints for trees like `abstract_tree` (ShapeDtypeStructs with shardings), so its
    first call dispatches at once; with the persistent compilation cache on, later processes load it."""
    leaves = jax.tree.leaves(abstract_tree)
    _fingerprint_fn(getattr(leaves[0].sharding, "mesh", None)).lower(abstract_tree, replicas.spreads(leaves)).compile()


class CompiledAhead:
    """Compiles the fingerprint pass of `abstract_tree` on a thread while the caller does something
    else (a restore's read: TensorStore releases the interpreter), so the check after it only
    dispatches. Not a daemon: `join` it before using the pass; a process exiting while XLA's
    compiler runs on a daemon thread aborts. A failure here is left for the call itself to hit."""

    def __init__(self, abstract_tree):
        self._thread = threading.Thread(target=self._compile, args=(abstract_tree,), name="fingerprint-compile")
        self._thread.start()

    @staticmethod
    def _compile(abstract_tree) -> None:
        try:
            compile_pass(abstract_tree)
        except Exception as err:  # noqa: BLE001  the pass itself raises it, with its own context
            logging.debug("compiling the fingerprint pass ahead failed: %s", err)

    def join(self) -> None:
        self._thread.join()


def to_ints(fingerprints) -> dict[str, int]:
    """{key path: 64-bit integer} from tree_fingerprints' output (one host transfer)."""
    flat = jax.tree_util.tree_flatten_with_path(fingerprints)[0]
    values = jax.device_get([lanes for _, lanes in flat])
    return {jax.tree_util.keystr(path): (int(v[0]) << 32) | int(v[1])
            for (path, _), v in zip(flat, np.asarray(values).reshape(-1, 2))}


def fingerprint_tree(tree) -> dict[str, int]:
    return to_ints(tree_fingerprints(tree))
