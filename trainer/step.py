"""The training step: loss, gradients and the Adam update of the whole state tree."""

from typing import Callable

import jax

from trainer.state import TrainState


def train_step(loss: Callable, state: TrainState, batch) -> tuple[TrainState, jax.Array]:
    """One optimizer step.

    Args:
      loss: (params, batch) -> scalar, the model spec's loss with its module bound.
      state: the whole state tree (donated by the program's jit).
      batch: this step's global batch.
    Returns:
      The new state and the loss of this step's batch (before the update).
    """
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), value

