"""Model specs the tests name with --model=tests.model_specs:<NAME>: each shows one case of the spec
protocol (trainer/models) that the built-in models and examples/ do not."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples import cnn_model, tiny_model
from trainer.models import ModelSpec


class NoisyClassifier(nn.Module):
    """tiny_model's classifier with a typed PRNG key of its own in the 'noise' collection."""

    @nn.compact
    def __call__(self, x):
        key = self.variable("noise", "key", lambda: jax.random.key(7))
        noise = jax.random.normal(key.value, x.shape) * 0.01
        key.value = jax.random.split(key.value)[0]
        return tiny_model.Classifier(16, 1)(x + noise)


def _noisy_loss(module, params, model_state, batch, rng):
    logits, updates = module.apply({"params": params, **model_state}, batch["inputs"], mutable=["noise"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), updates


_BASE = dict(synthetic_batch=tiny_model.synthetic_batch, init_inputs=lambda batch: batch["inputs"])

KEY_IN_STATE = ModelSpec(name="noisy", make_module=lambda config: NoisyClassifier(), loss=_noisy_loss, **_BASE)

# A loss that drops the model state its init made: check_model refuses it before anything is written.
DROPS_NOISE = ModelSpec(name="drops_noise", make_module=lambda config: NoisyClassifier(),
                        loss=lambda module, params, model_state, batch, rng: (
                            _noisy_loss(module, params, model_state, batch, rng)[0], {}), **_BASE)

# BatchNorm statistics with the older 3-argument loss: the trainer cannot carry them, so it refuses.
LEGACY_BATCHNORM = ModelSpec(
    name="legacy_bn", make_module=cnn_model.make_module, loss=lambda module, params, batch: jnp.zeros(()),
    synthetic_batch=cnn_model.synthetic_batch, init_inputs=lambda batch: batch["images"],
    fields=cnn_model.spec.fields)

OWN_OPTIMIZER = ModelSpec(name="sgd", make_module=lambda config: tiny_model.Classifier(16, 1),
                          loss=tiny_model.loss, make_optimizer=lambda config: optax.sgd(0.05), **_BASE)


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


NNX_MODULE = ModelSpec(name="nnx", make_module=lambda config: NnxMLP(nnx.Rngs(0)), loss=tiny_model.loss, **_BASE)
