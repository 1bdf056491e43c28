"""A small CNN with BatchNorm and dropout on synthetic images: a model with state of its own
(batch_stats), a per-step rng (dropout) and config fields of its own (--dropout_rate, --num_filters,
--image_size). Train it with the trainer's optimizer flags, e.g. AdamW, warmup + cosine, clipping
and gradient accumulation:

  python -m trainer.train --workdir=DIR --model=examples.cnn_model:spec --mesh=data=4,model=2 \\
      --optimizer=adamw --weight_decay=1e-4 --lr_schedule=warmup_cosine --warmup_steps=10 \\
      --grad_clip_norm=1.0 --grad_accum_steps=2 --learning_rate=3e-3 --dropout_rate=0.1
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer.models import ModelField, ModelSpec

NUM_CLASSES = 4
CHANNELS = 3


class CNN(nn.Module):
    num_filters: int
    dropout_rate: float

    @nn.compact
    def __call__(self, images, train: bool = True):
        x = images
        for i, features in enumerate((self.num_filters, 2 * self.num_filters)):
            x = nn.Conv(features, (3, 3), strides=(1 + i, 1 + i), use_bias=False)(x)  # BatchNorm centres it
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(NUM_CLASSES)(x)


def make_module(config):
    return CNN(config.model_field("num_filters"), config.model_field("dropout_rate"))


def synthetic_batch(config, key):
    """Images of noise with one brighter quadrant; the label is which. A pure function of the key."""
    size = config.model_field("image_size")
    noise_key, label_key = jax.random.split(key)
    labels = jax.random.randint(label_key, (config.batch_size,), 0, NUM_CLASSES)
    half = size // 2
    rows = (jnp.arange(size) >= half).astype(jnp.int32)
    quadrant = rows[:, None] * 2 + rows[None, :]  # 0..3 for each pixel
    bright = (quadrant[None, :, :] == labels[:, None, None]).astype(jnp.float32)[..., None]
    images = jax.random.normal(noise_key, (config.batch_size, size, size, CHANNELS), jnp.float32) + 2.0 * bright
    return {"images": images, "labels": labels}


def loss(module, params, model_state, batch, rng):
    """Cross entropy; BatchNorm's statistics come back updated, dropout draws from the step's rng."""
    logits, updates = module.apply({"params": params, **model_state}, batch["images"], train=True,
                                   rngs={"dropout": rng}, mutable=["batch_stats"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return value, {**model_state, **updates}


spec = ModelSpec(
    name="cnn",
    make_module=make_module,
    loss=loss,
    synthetic_batch=synthetic_batch,
    init_inputs=lambda batch: batch["images"],
    fields=(
        ModelField("dropout_rate", float, 0.1, "dropout before the classifier", minimum=0.0, maximum=0.9),
        ModelField("num_filters", int, 8, "filters of the first convolution (the second has twice as many)",
                   minimum=1),
        ModelField("image_size", int, 8, "image height and width (even)", minimum=4),
    ),
)
