"""Deterministic synthetic data: the global batch of step s is a pure function of (seed, s).

The batch key is fold_in(data_key, s), and the model's spec draws the batch from that key alone
(trainer/models), so a resume needs only the step number to draw the same rows. Batches are
produced by a jitted function whose output sharding splits the batch axis over 'data': each
device computes only its own rows (JAX's partitionable threefry makes the drawn values
independent of how the array is split), so no host ever holds, or gathers, the global batch,
and every mesh sees the same numbers.
"""

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainer.config import TrainConfig
from trainer.models import ModelSpec


def data_key(config: TrainConfig) -> jax.Array:
    """The key every batch is folded from; a constant of the program, never state."""
    return jax.random.fold_in(jax.random.key(config.seed), 1)


def step_rng(config: TrainConfig, step: jax.Array) -> jax.Array:
    """The loss's rng of `step` (dropout): fold_in(fold_in(key(seed), 2), step), like the batch key;
    stateless, so every mesh and every restart draws the same masks."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), 2), step)


def synthetic_batch(spec: ModelSpec, config: TrainConfig, step: jax.Array) -> dict[str, jax.Array]:
    """The global batch of `step`: same values on every mesh and every restart."""
    return spec.synthetic_batch(config, jax.random.fold_in(data_key(config), step))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch axis over 'data'; everything else (and the 'model' axis) replicated."""
    return NamedSharding(mesh, P("data"))


def make_batch_fn(spec: ModelSpec, config: TrainConfig, mesh: Mesh):
    """step -> global batch array, each device computing only its shard."""
    return jax.jit(functools.partial(synthetic_batch, spec, config), out_shardings=batch_sharding(mesh))
