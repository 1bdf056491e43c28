"""Save marks: a saved state's fingerprints and its probe's summaries, dispatched by on_step, not by save().

Dispatched inside save(), the fingerprint pass competes with Orbax's background write for the interpreter lock
and the device threads (on CPU ~20 ms at 1 GiB, 3.5x plain Orbax's save()). The Checkpointer knows its
step-cadence saves and probe windows, so its on_step dispatches their marks the moment the step's state comes
in, and save() dispatches none (checkpointing/_src/marking.py):

    state, loss = train_step(state, batch)
    checkpointer.on_step(step + 1, state, loss)   # marks_fn(shardings)(state, wanted): what is due at step + 1

The marks (uint32[n, 2] fingerprints, float32[n, 2] summaries; None where not asked), two executables per
layout: the fingerprints (each device hashes its slice, one all-reduce), compiled before a restart's restore,
and the summaries where the probe does not take them on the host (checkpointing/_src/probes.py), compiled on a
thread beside the step's compile (`compile_summaries_ahead`, from Checkpointer.prepare: compiled at the first
probe they stopped a TPU's loop 6-15 s; started at the restore, 3.7 s).
Neither holds a conditional nor is inside the step (that changed how XLA compiled the update). `step_marks`:
the same in a caller's jit, asked by a bool[2] `flags` (benchmarks' baseline). An unasked save (time-based,
preemption) dispatches the fingerprints itself.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpointing._src import executables
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import probes
from checkpointing._src import replicas


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What the state at one step needs from its step: `flags` goes into the caller's jit."""

    fingerprints: bool
    summaries: bool
    flags: jax.Array

    @property
    def any(self) -> bool:
        return self.fingerprints or self.summaries


_AHEAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="summaries-compile")
# Layouts (tree, shardings, shapes) whose marks_fn compile_marks has compiled: their fingerprints come from it.
_COMPILED: set[tuple] = set()


@functools.lru_cache(maxsize=32)
def request(mesh: Mesh | None, fingerprints: bool = False, summaries: bool = False) -> Wanted:
    """The (cached) request for one mesh: its flags are placed once, so a step sends nothing per call."""
    value = np.array([fingerprints, summaries])
    if mesh is None:
        return Wanted(fingerprints, summaries, jax.device_put(value))
    # From each process's own copy: device_put of a host value onto a multi-process mesh first checks that
    # every process passed the same one, an all-gather (and its compile) per call; these are the same by
    # construction (every process asks the same steps).
    with jax.transfer_guard_host_to_device("allow"):  # once per mesh and request (cached), never per step
        flags = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P()), lambda index: value[index])
    return Wanted(fingerprints, summaries, flags)


def step_marks(state, flags: jax.Array, shardings) -> tuple[jax.Array, jax.Array]:
    """Inside a jitted step: (fingerprints uint32[n, 2], summaries float32[n, 2]) of `state` (leaves in flatten
    order, on the NamedShardings `shardings`), each computed only when its flag is set (else zeros). Each device
    works on its shards under `lax.cond` (a collective there deadlocks XLA's CPU runtime once the executable
    comes from the persistent cache); the parts are combined after it. The fingerprints equal
    fingerprint.leaf_fingerprint's exactly; the summaries probes.leaf_summary's up to float32 rounding."""
    leaves, specs = jax.tree.leaves(state), [sharding.spec for sharding in jax.tree.leaves(shardings)]
    mesh = jax.tree.leaves(shardings)[0].mesh
    shapes = [_global_shape(x) for x in leaves]

    def local(flags, *shards):
        zeros = lambda width, dtype: jnp.zeros((len(shards), width), dtype)
        lanes = jax.lax.cond(flags[0], lambda: _shard_lanes(shards, specs, shapes, mesh), lambda: zeros(2, jnp.uint32))
        parts = jax.lax.cond(flags[1], lambda: jnp.stack([_local_parts_jit(x) for x in shards]),
                             lambda: zeros(3, jnp.float32))
        mask, axes = _owned(specs, mesh), tuple(mesh.axis_names)
        fingerprints = jax.lax.psum(jnp.where(mask[:, None], lanes, jnp.uint32(0)), axes)
        total = jax.lax.psum(jnp.where(mask, parts[:, 0], 0.0), axes)
        scale = jax.lax.pmax(parts[:, 1], axes)
        safe = jnp.where(scale > 0, scale, 1.0)
        squares = jax.lax.psum(jnp.where(mask, parts[:, 2] * jnp.square(parts[:, 1] / safe), 0.0), axes)
        return fingerprints, jnp.stack([total, jnp.where(scale > 0, safe * jnp.sqrt(squares), 0.0)], axis=1)

    in_specs = (P(), *(_padded(spec, x) for spec, x in zip(specs, leaves)))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), check_vma=False)(
        flags, *[_words_of(x) for x in leaves])


def _words_of(x: jax.Array) -> jax.Array:
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _global_shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(_words_of(x).shape)


def _padded(spec: P, x: jax.Array) -> P:
    """The spec of a leaf's words (a typed key's words have one axis more, never sharded)."""
    return P(*spec, *([None] * (len(_global_shape(x)) - len(spec))))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_lanes(shards, specs, shapes, mesh: Mesh) -> jax.Array:
    """uint32[n, 2]: each shard's part of its leaf's fingerprint (inside shard_map)."""
    return jnp.stack([_local_lanes_jit(x, spec, shape, mesh) for x, spec, shape in zip(shards, specs, shapes)])


def _owned(specs, mesh: Mesh) -> jax.Array:
    """bool[n]: whether this device's shard of each leaf counts (a replicated shard is counted once, at index 0)."""
    first = {axis: jax.lax.axis_index(axis) == 0 for axis in mesh.axis_names}
    used = [{axis for entry in spec for axis in _axes(entry)} for spec in specs]
    return jnp.stack([functools.reduce(jnp.logical_and, [first[a] for a in mesh.axis_names if a not in u],
                                       jnp.bool_(True)) for u in used])


def _local_lanes(shard: jax.Array, spec: P, shape: tuple[int, ...], mesh: Mesh) -> jax.Array:
    """This shard's part of fingerprint.leaf_fingerprint: its elements at their global flat indices."""
    bits = fingerprint_lib.as_uint32(shard)
    index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for axis in reversed(range(len(shape))):
        offset = jnp.uint32(0)
        for name in _axes(entries[axis]):  # major to minor: the shard's position along this dimension
            offset = offset * jnp.uint32(mesh.shape[name]) + jax.lax.axis_index(name).astype(jnp.uint32)
        coordinate = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) + offset * jnp.uint32(bits.shape[axis])
        index = index + coordinate * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return fingerprint_lib.lanes_of(bits, index)


def _local_parts(shard: jax.Array) -> jax.Array:
    """(sum, largest magnitude, sum of squares scaled by it) of this shard, as float32 (probes.leaf_summary)."""
    x = shard.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.stack([jnp.sum(x), scale, jnp.sum(jnp.square(x / safe))])


# Jitted on their own (as fingerprint._leaf_fingerprint): a parameter and its two Adam moments, of one
# shape and layout, are traced and lowered once (a restart's marks trace in 0.045 s, not 0.079 s, for the
# benchmark's mlp); XLA inlines the calls, so the values are the same.
_local_lanes_jit = jax.jit(_local_lanes, static_argnums=(1, 2, 3))
_local_parts_jit = jax.jit(_local_parts)


# Jitted per leaf (as fingerprint._leaf_fingerprint): leaves of one shape are traced and lowered once.
_leaf_summary = jax.jit(probes.leaf_summary)


def _stacked_fingerprints(state, shardings: tuple) -> jax.Array:
    """uint32[n, 2]: each leaf's fingerprint.leaf_fingerprint (the same integers), each leaf read once in the pod (a
    leaf replicated over processes is split over them, replicas.spread); the lanes meet in one all-reduce."""
    leaves = jax.tree.leaves(state)
    mesh = shardings[0].mesh
    specs = [(replicas.spread(sharding, x.shape, across_processes=True) or sharding).spec
             for x, sharding in zip(leaves, shardings, strict=True)]
    shapes = [_global_shape(x) for x in leaves]

    local = lambda *shards: jax.lax.psum(jnp.where(_owned(specs, mesh)[:, None], _shard_lanes(
        shards, specs, shapes, mesh), jnp.uint32(0)), tuple(mesh.axis_names))
    in_specs = tuple(_padded(spec, x) for spec, x in zip(specs, leaves))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)(
        *[_words_of(x) for x in leaves])


_stacked_summaries = lambda state: jnp.stack([_leaf_summary(x) for x in jax.tree.leaves(state)])  # noqa: E731


class MarksFn:
    """The marks of states on one layout: `(state, wanted) -> (fingerprints, summaries)`, each dispatched only
    when `wanted` asks for it, else None (executables: `.fingerprints` or compile_marks' `.compiled`, `.summaries`)."""

    def __init__(self, tree):
        self._tree = tree
        self.fingerprints = self.fingerprints_jit()
        self.compiled = None  # compile_marks: the fingerprints' executable, called without jit's dispatch
        replicated = NamedSharding(jax.tree.leaves(tree)[0].mesh, P())
        self.summaries = jax.jit(_stacked_summaries, in_shardings=(tree,), out_shardings=replicated)
        self._summaries_ahead: concurrent.futures.Future | None = None  # compile_summaries_ahead's executable

    def compile_summaries_ahead(self, abstract_state) -> None:
        """Compiles the summaries on a thread (a restart loads them from the persistent cache) while the loop
        trains: the first probe waits only for what is left of it."""
        if self._summaries_ahead is None:
            self._summaries_ahead = _AHEAD.submit(lambda: self.summaries.lower(abstract_state).compile())

    def summaries_compiled(self) -> None:
        """Waits for compile_summaries_ahead's compile, if one was started (its failure is summary()'s to handle)."""
        if self._summaries_ahead is not None:
            concurrent.futures.wait([self._summaries_ahead])

    def summary(self, state) -> jax.Array:  # a compile ahead that failed or does not fit: jit compiles its own
        ahead = self._summaries_ahead
        if ahead is not None and ahead.exception() is None:
            with contextlib.suppress(TypeError, ValueError):  # another layout than the one compiled for
                return ahead.result()(state)
        return self.summaries(state)

    def fingerprints_jit(self):
        """A new jit of the fingerprints (its own caches: what executables.load_or_compile keeps is compiled)."""
        replicated = NamedSharding(jax.tree.leaves(self._tree)[0].mesh, P())
        fingerprints = functools.partial(_stacked_fingerprints, shardings=tuple(jax.tree.leaves(self._tree)))
        return jax.jit(fingerprints, in_shardings=(self._tree,), out_shardings=replicated)

    def fingerprint(self, state) -> jax.Array:
        return (self.compiled or self.fingerprints)(state)

    def __call__(self, state, wanted: Wanted) -> tuple[jax.Array | None, jax.Array | None]:
        return (self.fingerprint(state) if wanted.fingerprints else None,
                self.summary(state) if wanted.summaries else None)


@functools.lru_cache(maxsize=16)
def _jitted(treedef, shardings: tuple) -> MarksFn:
    return MarksFn(jax.tree.unflatten(treedef, shardings))


def marks_fn(shardings) -> MarksFn:
    """The marks of states on `shardings` (NamedShardings on one mesh): one per layout, shared by its callers."""
    leaves, treedef = jax.tree.flatten(shardings)
    return _jitted(treedef, tuple(leaves))


def compile_marks(abstract_state, *, load_only: bool = False) -> str | None:
    """Compiles (or loads, checkpointing/_src/executables.py) the fingerprints of marks_fn for states like
    `abstract_state` (ShapeDtypeStructs with NamedShardings); this process's restores and unasked saves of such
    states then use it (no fingerprint pass beside it). Call on every process alike (a restore's check is a
    collective). Returns "disk" or "compiled"; `load_only`: None where none is kept (safe beside a compile)."""
    marks = marks_fn(jax.tree.map(lambda x: x.sharding, abstract_state))
    source = "disk"
    if not load_only:  # a compile kept on disk turns JAX's persistent cache off: no summaries compile beside it
        marks.summaries_compiled()
    if load_only:
        marks.compiled = executables.load_kept("marks-fingerprints", (abstract_state,), _FINGERPRINT_SOURCES)
    else:
        marks.compiled, source = executables.load_or_compile(
            "marks-fingerprints", marks.fingerprints_jit, (abstract_state,), _FINGERPRINT_SOURCES)
    if marks.compiled is None:
        return None
    _COMPILED.add(_layout(abstract_state))
    return source
# The modules whose code the fingerprints' executable runs (its kept copy's key hashes them).
_FINGERPRINT_SOURCES = (fingerprint_lib, replicas, sys.modules[__name__])


def _layout(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(x.sharding for x in leaves), tuple((tuple(x.shape), x.dtype) for x in leaves)


def compiled_for(tree) -> bool:
    """Whether compile_marks compiled the marks of trees like `tree` (arrays or ShapeDtypeStructs)."""
    try:
        return _layout(tree) in _COMPILED
    except (AttributeError, TypeError):  # a leaf without a sharding (a NumPy array): the pass
        return False


class Fingerprints:
    """A state's fingerprints, dispatched now, read by `ints()`: from compiled marks, else the pass (same values)."""

    def __init__(self, state):
        self._marks = self._pass = None
        if compiled_for(state):
            self._paths = leaf_paths(state)
            self._marks = marks_fn(jax.tree.map(lambda x: x.sharding, state)).fingerprint(state)
        else:
            self._pass = fingerprint_lib.tree_fingerprints(state)

    def ints(self) -> dict[str, int]:
        if self._marks is not None:
            return fingerprint_ints(self._marks, self._paths)
        return fingerprint_lib.to_ints(self._pass)


def fingerprints_of(state) -> dict[str, int]:
    """{key path: 64-bit fingerprint} of `state` (blocks until they are read back)."""
    return Fingerprints(state).ints()


def fingerprint_ints(fingerprints: jax.Array, paths: list[str]) -> dict[str, int]:
    """{key path: 64-bit fingerprint} from the marks' fingerprints of a state of leaf_paths `paths` (blocks)."""
    values = np.asarray(jax.device_get(fingerprints)).reshape(-1, 2)
    return {path: (int(v[0]) << 32) | int(v[1]) for path, v in zip(paths, values, strict=True)}


def summaries_of(summaries: jax.Array, paths: list[str]) -> dict[str, list[float]]:
    """{key path: [sum, norm]} from the marks' summaries of a state whose leaf_paths are `paths` (one transfer)."""
    values = np.asarray(jax.device_get(summaries), dtype=np.float64).reshape(-1, 2)
    return {path: [float(v[0]), float(v[1])] for path, v in zip(paths, values, strict=True)}


def leaf_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
