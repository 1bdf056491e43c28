"""Replays perturbed at the rounding level: what establishes the bound of a proof across layouts.

Two replays on two of the verifier's layouts are one sample of how far genuine executions of an interval
spread, and not its bound: the recording layout rounds in other orders (on 2 devices a deterministic wide
mlp recorded on data=4,model=2 lay 542x beyond the spread of data=2 and model=2), and rounding noise grows
chaotically with the interval's length. So the verifier replays the interval again with Monte Carlo
arithmetic at the step boundaries (as Verificarlo and CADNA estimate numerical error): after every step,
each float element of the state is multiplied by (1 + scale * N(0, 1)), where a leaf's scale is at least
the rounding a layout change gives that leaf in one step, measured here on the interval's first step on two
layouts (CALIBRATION times it), and never below FLOOR_ULPS units in the last place. A perturbation at least
as large as a layout change's, injected at every step, makes the members spread at least as far as a layout
change's rounding can carry a genuine execution; verifier/evidence.py bounds each quantity by MARGIN times
that spread.

The draws are `fold_in(fold_in(seed, step), leaf index)` with JAX's partitionable threefry: the same
numbers on every mesh, so a member is reproducible and independent of the layout it runs on.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from checkpointing.verification import compare

# The least per-step perturbation, in units in the last place of the leaf's dtype: a leaf the calibration pair
# happened to round alike may round otherwise on the recording layout, by at most about a unit per element and
# step. More buries evidence: at 16, one input element x (1 + 1e-3) passed on data=2 at 5.45x the spread.
FLOOR_ULPS = 1.0
CALIBRATION = 4.0  # a leaf's perturbation: this many times its measured one-step rounding across layouts
CEILING = 1e-2  # the largest relative perturbation: a leaf that is all rounding noise still keeps its scale


def one_step_rtols(state_a, state_b) -> dict[str, float]:
    """Per float leaf, ||a - b|| / ||a||: how far one step on two layouts rounded it apart (same shardings)."""
    values = _rtols(state_a, state_b)
    flat = jax.tree_util.tree_flatten_with_path(values)[0]
    numbers = jax.device_get([v for _, v in flat])
    return {jax.tree_util.keystr(path): float(v) for (path, _), v in zip(flat, numbers)}


@jax.jit
def _rtols(state_a, state_b):
    def one(a, b):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.float32(0)
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        scale = compare.norm(a32)
        return jnp.where(scale > 0, compare.norm(a32 - b32) / jnp.where(scale > 0, scale, 1.0), 0.0)

    return jax.tree.map(one, state_a, state_b)


def scales(state, rtols: dict[str, float]) -> dict[str, float]:
    """Each float leaf's relative perturbation per step (module docstring); a NaN measurement takes the ceiling."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue
        key = jax.tree_util.keystr(path)
        floor = FLOOR_ULPS * float(jnp.finfo(leaf.dtype).eps)
        measured = CALIBRATION * rtols.get(key, 0.0)
        found[key] = float(np.clip(measured if np.isfinite(measured) else CEILING, floor, max(CEILING, floor)))
    return found


class Perturbation:
    """`(state, step) -> state` after every step of a member's replay: the module docstring's draw."""

    def __init__(self, state_shardings, leaf_scales: dict[str, float], seed: int):
        self.seed = seed
        self.scales = leaf_scales
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state_shardings)[0]]
        self._factors = tuple(leaf_scales.get(path, 0.0) for path in paths)
        self._shardings = tuple(jax.tree.leaves(state_shardings))
        self._key = jax.random.key(seed)

    def __call__(self, state, step: int):
        # Keyed by the state's own tree: each program builds its own optimizer, a static part of its state.
        apply = _perturber(jax.tree.structure(state), self._shardings, self._factors)
        return apply(state, jax.random.fold_in(self._key, step))

    def largest(self) -> float:
        return max(self._factors, default=0.0)


@functools.lru_cache(maxsize=32)
def _perturber(treedef, shardings: tuple, factors: tuple):
    def apply(state, key):
        leaves = jax.tree.leaves(state)
        out = []
        for index, (leaf, factor) in enumerate(zip(leaves, factors)):
            if factor == 0.0 or not jnp.issubdtype(leaf.dtype, jnp.inexact):
                out.append(leaf)
                continue
            noise = jax.random.normal(jax.random.fold_in(key, index), leaf.shape, jnp.float32)
            out.append((leaf.astype(jnp.float32) * (1.0 + factor * noise)).astype(leaf.dtype))
        return jax.tree.unflatten(treedef, out)

    return jax.jit(apply, out_shardings=jax.tree.unflatten(treedef, shardings), donate_argnums=0)
