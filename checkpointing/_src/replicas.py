"""A check reads each leaf once, not once per replica.

A leaf replicated over a mesh axis (a data-parallel state: P(None, 'model') on data=4,model=2) is held
whole by every replica, and a reduction over it, partitioned by XLA, runs on each of them: 4x the reads
of the leaf there. Inside the check's jit, `spread` constrains such a leaf to a sharding that also splits
it over those axes, each appended after the axes that already split the dimension, so that every device
keeps a slice of the block it holds (a local slice, no collective); the partial results meet in the small
gather of the check's replicated output. On the verifier's data=4,model=2 mesh (8 CPU devices, 260 MiB)
the fingerprint pass took 0.058 -> 0.026 s, and the finite check 0.12 -> 0.03 s (compare.nonfinite_leaves).

By default only axes within one process are used: XLA combines each leaf's partial results in a
collective of its own, and between hosts (gloo here) one per leaf cost what the halved reads saved. The
save marks' fingerprints split over processes too (`across_processes`) and combine every leaf's partial
lanes in one all-reduce (checkpointing/_src/marks.py). Only for integer sums and flags: their values are the
same for any split.
"""

import functools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


def spread(sharding, shape: tuple[int, ...], across_processes: bool = False) -> NamedSharding | None:
    """`sharding` also split over the mesh axes the leaf is replicated on (within a process, where a
    dimension divides; `across_processes`, over any axis: for a program whose partial results meet in
    one collective of its own, checkpointing/_src/marks.py), or None where nothing changes (then the check's
    program is as before)."""
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    mesh, spec = sharding.mesh, list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if any(entry is not None and not isinstance(entry, (str, tuple)) for entry in spec):
        return None  # P.UNCONSTRAINED and the like: left to XLA
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
        return None
    used = {axis for entry in spec for axis in _axes(entry)}
    changed = False
    for axis in mesh.axis_names:
        if axis in used or mesh.shape[axis] == 1 or not (across_processes or _within_processes(mesh, axis)):
            continue
        # The dimension with the largest blocks first: the slices stay long and contiguous.
        for dim in sorted(range(len(shape)), key=lambda d: -(shape[d] // _ways(mesh, spec[d]))):
            if shape[dim] % (_ways(mesh, spec[dim]) * mesh.shape[axis]) == 0:
                spec[dim], changed = _axes(spec[dim]) + (axis,), True
                break
    return NamedSharding(mesh, P(*spec)) if changed else None


def spreads(leaves) -> tuple:
    """spread() of each leaf (arrays or ShapeDtypeStructs): hashable, a static argument of a jit."""
    return tuple(spread(getattr(leaf, "sharding", None), tuple(leaf.shape)) for leaf in leaves)


def constrained(x, target: NamedSharding | None):
    """`x` inside a jit, constrained to its spread sharding (as is where there is none)."""
    return x if target is None else jax.lax.with_sharding_constraint(x, target)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(mesh: Mesh, entry) -> int:
    return int(np.prod([mesh.shape[axis] for axis in _axes(entry)], dtype=np.int64))


@functools.lru_cache(maxsize=64)
def _within_processes(mesh: Mesh, axis: str) -> bool:
    processes = np.vectorize(lambda device: device.process_index, otypes=[np.int64])(mesh.devices)
    return axis_within_processes(processes, mesh.axis_names.index(axis))


def axis_within_processes(processes: np.ndarray, axis: int) -> bool:
    """Whether every line of the mesh along `axis` (the devices' process indices) stays in one process."""
    return bool(np.all(processes == np.take(processes, [0], axis=axis)))
