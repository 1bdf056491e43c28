"""`transformer`: a small decoder-only causal language model over {"tokens"} batches: synthetic
arithmetic sequences, or the records of --data=records:... (each seq_len + 1 tokens: reads
tokens[:-1], predicts tokens[1:])."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer.config import ConfigError, TrainConfig
from trainer.models import ModelSpec

MAX_STRIDE = 8  # sequences count up by 1..MAX_STRIDE-1 tokens, mod the vocabulary


class DecoderBlock(nn.Module):
    hidden_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        seq_len = x.shape[1]
        causal = nn.make_causal_mask(jnp.ones((x.shape[0], seq_len), jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, h, mask=causal)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.hidden_dim)(h)
        return x + nn.Dense(self.hidden_dim)(nn.gelu(h))


class Transformer(nn.Module):
    vocab_size: int
    seq_len: int
    hidden_dim: int
    num_layers: int
    num_heads: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.hidden_dim)(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.seq_len, self.hidden_dim))
        x = x + positions[None, : tokens.shape[1]]
        for _ in range(self.num_layers):
            x = DecoderBlock(self.hidden_dim, self.num_heads)(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def make_module(config: TrainConfig) -> Transformer:
    return Transformer(config.vocab_size, config.seq_len, config.hidden_dim, config.num_layers, config.num_heads)


def loss(module: Transformer, params, batch) -> jax.Array:
    """Next-token cross-entropy."""
    tokens = batch["tokens"]
    logits = module.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def synthetic_batch(config: TrainConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Arithmetic sequences mod vocab: the next token is predictable from the ones before it, so the
    loss has somewhere to fall."""
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (config.batch_size, 1), 0, config.vocab_size)
    stride = jax.random.randint(stride_key, (config.batch_size, 1), 1, MAX_STRIDE)
    positions = jnp.arange(config.seq_len + 1, dtype=jnp.int32)[None, :]
    return {"tokens": (start + stride * positions) % config.vocab_size}


def check_config(config: TrainConfig) -> None:
    if config.hidden_dim % config.num_heads:
        raise ConfigError(f"--num_heads={config.num_heads} does not divide --hidden_dim={config.hidden_dim}")


SPEC = ModelSpec(
    name="transformer",
    make_module=make_module,
    loss=loss,
    synthetic_batch=synthetic_batch,
    init_inputs=lambda batch: batch["tokens"][:, :-1],
    # Measured over 100 steps on data=8, data=4/model=2, data=2/model=4, model=8 and 1 device
    # (tests/test_trainer.py prints the spread): 1.1e-5 at the test sizes and 1.6e-5 at the
    # default sizes (the loss falls ~50x, so the relative error grows as the loss shrinks). The
    # bound keeps a ~10x margin.
    cross_mesh_loss_rtol=2e-4,
    # Measured over 10 and 50 replayed steps on data=8, model=8 and data=2/model=4 against
    # data=4/model=2: every leaf within 2.4e-6 of its scale, except the leaves driven by rounding
    # noise (an attention key bias has an exactly-zero gradient: softmax ignores a per-query
    # constant; Adam scales the noise into updates of its own size), which differ by up to 1.6x
    # their movement and are bounded by it separately (verifier/tolerances.py).
    cross_mesh_state_rtol=1e-4,
    check_config=check_config,
)
