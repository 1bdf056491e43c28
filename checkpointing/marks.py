"""Save marks: a saved state's fingerprints and its probe's summaries, computed inside the caller's step.

A save needs each leaf's fingerprint (the manifest), and a probe each leaf's sum and norm a few steps
later (checkpointing/probes.py). Dispatched as passes of their own, each is one more jit call at a save
step; on CPU, while Orbax's background write holds the interpreter lock and the device threads, that
call alone blocked save() for ~20 ms at 1 GiB (3.5x plain Orbax's save()). Computed by the step itself,
under `lax.cond` on a flag the host passes in (one executable; the branch not taken costs nothing),
they ride on a dispatch the loop makes anyway. The step that writes the saved state computes them from
its output, so nothing waits and nothing reads a donated buffer:

    wanted = checkpointer.marks_wanted(step + 1)                    # host decision, the same everywhere
    state, loss, marks = train_step(state, batch, wanted.flags)      # inside: step_marks(new_state, flags)
    checkpointer.on_step(step + 1, state, loss, marks=marks)

`flags` is a replicated bool[2] device array (fingerprints, summaries), made once per mesh; the marks
are (uint32[n, 2] fingerprints, float32[n, 2] summaries) in the state's leaf order, both replicated (the
caller's jit gives them out_shardings=P()). A step the Checkpointer did not ask for marks is saved as
before: save() dispatches the fingerprint pass itself (a time-based or preemption save is not known a
step ahead). The values are the same: the fingerprint is integer arithmetic (tests/test_marks.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpointing import fingerprint as fingerprint_lib
from checkpointing import probes


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What the state at one step needs from its step: `flags` goes into the caller's jit."""

    fingerprints: bool
    summaries: bool
    flags: jax.Array

    @property
    def any(self) -> bool:
        return self.fingerprints or self.summaries


NOTHING = Wanted(False, False, None)  # what a step not asked for marks gives (host side only)


@functools.lru_cache(maxsize=32)
def request(mesh: Mesh | None, fingerprints: bool = False, summaries: bool = False) -> Wanted:
    """The (cached) request for one mesh: its flags are placed once, so a step sends nothing per call."""
    value = np.array([fingerprints, summaries])
    flags = jax.device_put(value, NamedSharding(mesh, P()) if mesh is not None else None)
    return Wanted(fingerprints, summaries, flags)


def step_marks(state, flags: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside a jitted step: (fingerprints uint32[n, 2], summaries float32[n, 2]) of `state` (its leaves in
    flatten order), each computed only when its flag is set (else zeros)."""
    leaves = jax.tree.leaves(state)

    def fingerprints(leaves):
        return jnp.stack([fingerprint_lib.leaf_fingerprint(x) for x in leaves])

    def summaries(leaves):
        return jnp.stack([probes.leaf_summary(x) for x in leaves])

    zeros = lambda dtype: lambda leaves: jnp.zeros((len(leaves), 2), dtype)
    return (jax.lax.cond(flags[0], fingerprints, zeros(jnp.uint32), leaves),
            jax.lax.cond(flags[1], summaries, zeros(jnp.float32), leaves))


def fingerprint_ints(fingerprints: jax.Array, paths: list[str]) -> dict[str, int]:
    """{key path: 64-bit fingerprint} from the marks' fingerprints of a state whose leaf_paths are `paths`
    (one host transfer; blocks until they are ready)."""
    values = np.asarray(jax.device_get(fingerprints)).reshape(-1, 2)
    return {path: (int(v[0]) << 32) | int(v[1]) for path, v in zip(paths, values, strict=True)}


def summaries_of(summaries: jax.Array, paths: list[str]) -> dict[str, list[float]]:
    """{key path: [sum, norm]} from the marks' summaries of a state whose leaf_paths are `paths` (one transfer)."""
    values = np.asarray(jax.device_get(summaries), dtype=np.float64).reshape(-1, 2)
    return {path: [float(v[0]), float(v[1])] for path, v in zip(paths, values, strict=True)}


def leaf_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
