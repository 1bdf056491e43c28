"""The two models the trainer runs, and their losses.

`mlp` is the seeds' regression (predict the sum of the features); `transformer` is a small
decoder-only language model over synthetic token sequences (see trainer.data).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer.config import TrainConfig


class MLP(nn.Module):
    hidden_dim: int
    num_layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers):
            x = nn.relu(nn.Dense(self.hidden_dim)(x))
        return nn.Dense(1)(x)


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


def make_model(config: TrainConfig) -> nn.Module:
    if config.model == "mlp":
        return MLP(config.hidden_dim, config.num_layers)
    return Transformer(config.vocab_size, config.seq_len, config.hidden_dim, config.num_layers,
                       config.num_heads)


def loss_fn(model: nn.Module, params, batch) -> jax.Array:
    """Mean squared error for the mlp; next-token cross-entropy for the transformer."""
    if isinstance(model, MLP):
        x, y = batch["inputs"], batch["targets"]
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)
    tokens = batch["tokens"]
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def example_batch_shapes(config: TrainConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shapes of one batch; the data module fills them, init uses them to trace the model."""
    if config.model == "mlp":
        return {
            "inputs": jax.ShapeDtypeStruct((config.batch_size, config.input_dim), jnp.float32),
            "targets": jax.ShapeDtypeStruct((config.batch_size, 1), jnp.float32),
        }
    return {"tokens": jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)}
