"""The training step: loss, gradients and the optimizer update of the whole state tree, with the
model's state carried through the loss and a few scalars (gradient norm, parameter norm, learning
rate) computed inside the same executable."""

from typing import Callable

import jax
import optax

from checkpointing.inspection import compile_marks
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
    """The jitted step as the replay protocol calls it, (state, batch) -> (state, loss), with its scalars
    and marks for the trainer's loop (`with_scalars`), and its marks alone for the verifier's cheap proof
    (`with_marks`): one step executable and the marks' two (checkpointing.marks_fn: fingerprints,
    summaries) serve all three, so every caller computes the same numbers.

    The marks are executables of their own, dispatched right after the step and only at the steps asked:
    inside the step they would change how XLA compiles the update (its losses then differed in the last
    bits from the step without them, and so did every cross-layout drift).
    """

    def __init__(self, jitted, marks_fn):
        self.jitted = jitted
        self._marks_fn = marks_fn  # checkpointing.marks_fn of the state's shardings: (state, wanted) -> marks

    def __call__(self, state, batch):
        new_state, loss, _ = self.jitted(state, batch)
        return new_state, loss

    def with_scalars(self, state, batch, wanted=None):
        """(state, loss, scalars, marks): marks per `wanted` (a Checkpointer.marks_wanted answer; None or
        nothing asked: None, and nothing is dispatched for them)."""
        new_state, loss, scalars = self.jitted(state, batch)
        marks = self._marks_fn(new_state, wanted) if wanted is not None and wanted.any else None
        return new_state, loss, scalars, marks

    def with_marks(self, state, batch, wanted):
        new_state, loss, _, marks = self.with_scalars(state, batch, wanted)
        return new_state, loss, marks

    def lower(self, state, batch):
        return self.jitted.lower(state, batch)

    @staticmethod
    def compile_marks(abstract_state, load_only: bool = False) -> str | None:
        """Compiles (or loads, checkpointing/_src/executables.py) the marks' fingerprints; the Checkpointer's
        restores and unasked saves then use them too. Returns "disk" or "compiled" (None: load_only found none)."""
        return compile_marks(abstract_state, load_only=load_only)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()
