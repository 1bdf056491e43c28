"""A classifier written the common way: Dense layers with their bias, each followed by BatchNorm, then
LayerNorm and dropout before the output layer, on tiny_model's synthetic features.

A bias right before BatchNorm gets no gradient (BatchNorm subtracts the batch mean it shifts), only
rounding noise, which Adam turns into full-size updates: those biases and the running means after them
drift chaotically from one layout to another while the losses agree. Kept as a user writes it: the
verifier must prove it across layouts anyway (docs/verifier.md).

  python -m trainer.train --workdir=DIR --model=examples.bn_classifier:spec --mesh=data=4,model=2
"""

import flax.linen as nn
import optax

from examples import tiny_model
from trainer.models import ModelField, ModelSpec


class Classifier(nn.Module):
    hidden_dim: int
    num_layers: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(self.num_layers):
            x = nn.Dense(self.hidden_dim)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = nn.LayerNorm()(x)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(tiny_model.NUM_CLASSES)(x)


def make_module(config):
    return Classifier(config.hidden_dim, config.num_layers, config.model_field("dropout_rate"))


def loss(module, params, model_state, batch, rng):
    """Cross entropy; BatchNorm's statistics come back updated, dropout draws from the step's rng."""
    logits, updates = module.apply({"params": params, **model_state}, batch["inputs"], train=True,
                                   rngs={"dropout": rng}, mutable=["batch_stats"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return value, {**model_state, **updates}


spec = ModelSpec(
    name="bn_classifier",
    make_module=make_module,
    loss=loss,
    synthetic_batch=tiny_model.synthetic_batch,
    init_inputs=lambda batch: batch["inputs"],
    check_config=tiny_model.check_config,
    # tiny_model's numbers, copied as a user would: the verifier measures the noise itself, these are floors.
    cross_mesh_loss_rtol=1e-5,
    cross_mesh_state_rtol=2e-5,
    fields=(ModelField("dropout_rate", float, 0.1, "dropout before the output layer", minimum=0.0, maximum=0.9),),
)
