"""`transformer`: a small decoder-only causal language model over {"tokens"} batches: synthetic
arithmetic sequences, or the records of --data=records:... (each seq_len + 1 tokens: reads
tokens[:-1], predicts tokens[1:])."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer.config import ConfigError, TrainConfig
from trainer.models import ModelField, ModelSpec, StateTolerance

F32_LOSS_RTOL, F32_STATE_RTOL = 2e-4, 1e-4  # float32 compute: measured, see SPEC
# bfloat16 compute, measured with `python -m verifier.calibrate` (docs/training.md's table) from step 20
# on data=8 and data=2,model=4 against data=4,model=2 at the test sizes, windows of 1..32 steps: loss
# lists within 1.5e-3 (bound ~10x); every signal leaf within 6.3e-2 of max(norm, movement) and the
# smallest broken-resume signal 0.65 (13x): the state bound sits ~3x from both. The attention key
# biases (gradient: rounding noise) have an Adam first moment 3e-4..7e-4 of the largest, every other
# leaf's is above 3e-2: bfloat16 noise is ~6e4x float32's, so its noise ratio is 3e-3, not 1e-5.
# Zeroed Adam moments move the loss by 2.8e-2 within 2 steps, near the loss bound: in bf16 the state
# comparison, not the loss list, catches them. From the init the biases (zero at init, moved by Adam's
# first update g/|g|) drift 0.35 after one step and 0.16 from 8 steps on: a first interval shorter than
# 8 steps does not prove across layouts.
BF16_LOSS_RTOL = 1.5e-2
BF16_STATE_RTOL = StateTolerance(0.2, noise_ratio=3e-3)
MAX_STRIDE = 8  # sequences count up by 1..MAX_STRIDE-1 tokens, mod the vocabulary


class DecoderBlock(nn.Module):
    hidden_dim: int
    num_heads: int
    dtype: jnp.dtype = jnp.float32  # compute; params stay float32 (flax's param_dtype)

    @nn.compact
    def __call__(self, x):
        seq_len = x.shape[1]
        causal = nn.make_causal_mask(jnp.ones((x.shape[0], seq_len), jnp.int32))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype)(h, h, mask=causal)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * self.hidden_dim, dtype=self.dtype)(h)
        return x + nn.Dense(self.hidden_dim, dtype=self.dtype)(nn.gelu(h))


class Transformer(nn.Module):
    vocab_size: int
    seq_len: int
    hidden_dim: int
    num_layers: int
    num_heads: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.hidden_dim, dtype=self.dtype)(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.seq_len, self.hidden_dim))
        x = x + positions[None, : tokens.shape[1]].astype(self.dtype)
        for _ in range(self.num_layers):
            x = DecoderBlock(self.hidden_dim, self.num_heads, self.dtype)(x)
        logits = nn.Dense(self.vocab_size, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return logits.astype(jnp.float32)  # the loss in float32 whatever the compute dtype


COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_module(config: TrainConfig) -> Transformer:
    return Transformer(config.vocab_size, config.seq_len, config.hidden_dim, config.num_layers, config.num_heads,
                       COMPUTE_DTYPES[config.model_field("compute_dtype")])


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
    cross_mesh_loss_rtol=F32_LOSS_RTOL,
    # Measured over 10 and 50 replayed steps on data=8, model=8 and data=2/model=4 against
    # data=4/model=2: every leaf within 2.4e-6 of its scale, except the leaves driven by rounding
    # noise (an attention key bias has an exactly-zero gradient: softmax ignores a per-query
    # constant; Adam scales the noise into updates of its own size), which differ by up to 1.6x
    # their movement and are bounded by it separately (verifier/tolerances.py).
    cross_mesh_state_rtol=F32_STATE_RTOL,
    check_config=check_config,
    fields=(ModelField("compute_dtype", str, "float32", "activations' dtype; params and Adam moments stay float32",
                       choices=tuple(COMPUTE_DTYPES)),),
    # bfloat16 compute: measured on data=8, data=4/model=2, data=2/model=4 (docs/training.md's table), with
    # its own noise rule (StateTolerance).
    tolerances=lambda config: (BF16_LOSS_RTOL, BF16_STATE_RTOL) if config.model_field("compute_dtype") == "bfloat16"
    else (F32_LOSS_RTOL, F32_STATE_RTOL),
)
