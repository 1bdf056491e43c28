"""Deterministic synthetic data: the global batch of step s is a pure function of (seed, s).

The batch key is fold_in(data_key, s), so a resume needs only the step number to draw the
same rows. Batches are produced by a jitted function whose output sharding splits the batch
axis over 'data': each device computes only its own rows (JAX's partitionable threefry makes
the drawn values independent of how the array is split), so no host ever holds, or gathers,
the global batch, and every mesh sees the same numbers.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainer.config import TrainConfig

MAX_STRIDE = 8  # transformer sequences count up by 1..MAX_STRIDE-1 tokens, mod the vocabulary


def data_key(config: TrainConfig) -> jax.Array:
    """The key every batch is folded from; a constant of the program, never state."""
    return jax.random.fold_in(jax.random.key(config.seed), 1)


def synthetic_batch(config: TrainConfig, step: jax.Array) -> dict[str, jax.Array]:
    """The global batch of `step`: same values on every mesh and every restart."""
    key = jax.random.fold_in(data_key(config), step)
    if config.model == "mlp":
        inputs = jax.random.normal(key, (config.batch_size, config.input_dim), jnp.float32)
        return {"inputs": inputs, "targets": jnp.sum(inputs, axis=1, keepdims=True)}
    # Arithmetic sequences mod vocab: the next token is predictable from the ones before it,
    # so the loss has somewhere to fall.
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (config.batch_size, 1), 0, config.vocab_size)
    stride = jax.random.randint(stride_key, (config.batch_size, 1), 1, MAX_STRIDE)
    positions = jnp.arange(config.seq_len + 1, dtype=jnp.int32)[None, :]
    return {"tokens": (start + stride * positions) % config.vocab_size}


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch axis over 'data'; everything else (and the 'model' axis) replicated."""
    return NamedSharding(mesh, P("data"))


def make_batch_fn(config: TrainConfig, mesh: Mesh):
    """step -> global batch array, each device computing only its shard."""
    return jax.jit(functools.partial(synthetic_batch, config), out_shardings=batch_sharding(mesh))
