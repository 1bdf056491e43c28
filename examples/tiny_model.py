"""A model of your own, outside the trainer: an MLP classifier on synthetic data, sized by the
trainer's flags (--input_dim, --hidden_dim, --num_layers, --batch_size). trainer/models documents
each field of the `ModelSpec` at the end.

  python -m trainer.train --workdir=DIR --model=examples.tiny_model:spec --mesh=data=4,model=2
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from trainer.config import ConfigError
from trainer.models import ModelSpec

NUM_CLASSES = 4


class Classifier(nn.Module):
    hidden_dim: int
    num_layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers):
            x = nn.gelu(nn.Dense(self.hidden_dim)(x))
        return nn.Dense(NUM_CLASSES)(x)


def synthetic_batch(config, key):
    """Features cut into NUM_CLASSES chunks; the label is the chunk with the largest sum. A pure
    function of the key: the trainer folds the step into it and shards the rows."""
    inputs = jax.random.normal(key, (config.batch_size, config.input_dim), jnp.float32)
    chunk_sums = inputs.reshape(config.batch_size, NUM_CLASSES, -1).sum(axis=2)
    return {"inputs": inputs, "labels": jnp.argmax(chunk_sums, axis=1)}


def loss(module, params, batch):
    logits = module.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def check_config(config):
    if config.input_dim % NUM_CLASSES:
        raise ConfigError(f"--input_dim={config.input_dim} must be a multiple of {NUM_CLASSES} for {__name__}")


def partition(shape, model_size):
    """Sharding hint: each kernel's rows (its inputs) split over 'model'; biases replicated."""
    return P("model", None) if len(shape) == 2 and shape[0] % model_size == 0 else P()


spec = ModelSpec(
    name="tiny_classifier",
    make_module=lambda config: Classifier(config.hidden_dim, config.num_layers),
    loss=loss,
    synthetic_batch=synthetic_batch,
    init_inputs=lambda batch: batch["inputs"],
    check_config=check_config,
    partition=partition,
)
