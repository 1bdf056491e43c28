"""The training step: loss, gradients and the optimizer update of the whole state tree, with the
model's state carried through the loss and a few scalars (gradient norm, parameter norm, learning
rate) computed inside the same executable."""

from typing import Callable

import jax
import optax

from trainer.state import KeyCodec, TrainState


def train_step(loss: Callable, takes_model_state: bool, codec: KeyCodec, rng_of: Callable,
               learning_rate: Callable | None, state: TrainState, batch) -> tuple[TrainState, jax.Array, dict]:
    """One step.

    Args:
      loss: the spec's loss with its module bound: (params, model_state, batch, rng) -> (loss,
        model_state), or (params, batch) -> loss when `takes_model_state` is False.
      codec: the typed keys of the model state (stored as key_data, handed to the loss as keys).
      rng_of: step -> the loss's rng of that step (trainer/data.py's step_rng).
      learning_rate: step -> the rate its update uses, or None when unknown (a spec's own optimizer).
      state: the whole state tree (donated by the program's jit).
      batch: this step's global batch.
    Returns:
      The new state, the loss of this step's batch (before the update) and {name: scalar}.
    """
    if takes_model_state:
        def objective(params):
            value, model_state = loss(params, codec.decode(state.model_state), batch, rng_of(state.step))
            return value, codec.encode(model_state)

        (value, model_state), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    else:
        value, grads = jax.value_and_grad(loss)(state.params, batch)
        model_state = state.model_state
    new_state = state.apply_gradients(grads=grads).replace(model_state=model_state)
    scalars = {"grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(new_state.params)}
    if learning_rate is not None:
        scalars["learning_rate"] = learning_rate(state.step)
    return new_state, value, scalars


class StepFn:
    """The jitted step as the replay protocol calls it, (state, batch) -> (state, loss), and with its scalars
    for the trainer's loop (`with_scalars`): one executable serves both, so every caller computes the same
    numbers."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, state, batch):
        new_state, loss, _ = self.jitted(state, batch)
        return new_state, loss

    def with_scalars(self, state, batch):
        """(state, loss, scalars)."""
        return self.jitted(state, batch)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()
