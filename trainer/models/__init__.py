"""The model registry: one `ModelSpec` per model, the only place that knows a model by its name.

A spec holds everything the trainer needs from a model, so no other module branches on which
model runs (nanodo's model factory does the same). Built in: `mlp` and `transformer`
(trainer/models/mlp.py, trainer/models/transformer.py). A model of your own lives in any
importable module and is named `--model=package.module:attribute`, the attribute being a
ModelSpec or a function of no arguments returning one (examples/tiny_model.py is a whole one).

What a spec must honour for a run to resume and verify on any mesh:
- `synthetic_batch` is a pure function of its key: the data module passes fold_in(data key, step)
  and shards the output over 'data' (each device computes only its rows), so the same step draws
  the same rows on every mesh and after every restart.
- `partition` decides a leaf's layout from its shape alone, so a parameter and its two Adam
  moments always share one.
- the tolerances are measured: run the model on two meshes and keep a ~10x margin over the spread.
"""

import dataclasses
import importlib
from typing import Any, Callable

from jax.sharding import PartitionSpec as P

from trainer.config import ConfigError, TrainConfig

BUILT_IN = ("mlp", "transformer")
_BUILT_IN_PATHS = {"mlp": "trainer.models.mlp:SPEC", "transformer": "trainer.models.transformer:SPEC"}


def default_partition(shape: tuple[int, ...], model_size: int) -> P:
    """The default sharding rule: a leaf with two or more dimensions is split over 'model' along its
    last dimension if the 'model' size divides it, else along its first; anything else (biases,
    scalars, the step, Adam's count, shapes 'model' does not divide) is replicated."""
    if len(shape) >= 2 and model_size > 1:
        if shape[-1] % model_size == 0:
            return P(*([None] * (len(shape) - 1)), "model")
        if shape[0] % model_size == 0:
            return P("model")
    return P()


def accept_any_config(config: TrainConfig) -> None:
    """The default `check_config`: the model takes any config the trainer accepts."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model: how to build it, train it, feed it and how far two meshes may disagree on it."""

    name: str  # Shown in logs; the config records the --model value it was resolved from.
    make_module: Callable[[TrainConfig], Any]  # config -> flax module.
    loss: Callable[[Any, Any, dict], Any]  # (module, params, batch) -> scalar loss of the batch.
    synthetic_batch: Callable[[TrainConfig, Any], dict]  # (config, key) -> {name: global array}.
    init_inputs: Callable[[dict], Any]  # batch -> what module.init is traced with (zeros of its shape).
    # Largest relative difference per step between two loss lists of the same run on two meshes.
    cross_mesh_loss_rtol: float
    # Per leaf: ||replayed - saved|| <= rtol * max(||replayed||, movement) (verifier/tolerances.py).
    cross_mesh_state_rtol: float
    check_config: Callable[[TrainConfig], None] = accept_any_config  # raises ConfigError naming the flag.
    partition: Callable[[tuple[int, ...], int], P] = default_partition  # (shape, model size) -> layout.

    def __post_init__(self):
        for field in ("make_module", "loss", "synthetic_batch", "init_inputs", "check_config", "partition"):
            if not callable(getattr(self, field)):
                raise ConfigError(f"model {self.name!r}: {field} must be callable")
        for field in ("cross_mesh_loss_rtol", "cross_mesh_state_rtol"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"model {self.name!r}: {field} must be a finite number >= 0, got {value!r}")


def resolve(name: str) -> ModelSpec:
    """The spec of a built-in name or of `package.module:attribute`; a ConfigError naming the value
    and what is wrong with it otherwise (one line, so the trainer exits 2 with it)."""
    path = _BUILT_IN_PATHS.get(name, name)
    module_name, colon, attribute = str(path).partition(":")
    if not (colon and module_name and attribute):
        raise _error(name, f"not a built-in model ({', '.join(BUILT_IN)}) nor package.module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise _error(name, f"module {module_name} not found") from None
        raise _error(name, f"importing {module_name} failed: {_first_line(err)}") from None
    except Exception as err:  # whatever a user's module raises while importing is a bad --model
        raise _error(name, f"importing {module_name} failed: {_first_line(err)}") from None
    if not hasattr(module, attribute):
        raise _error(name, f"module {module_name} has no attribute {attribute}")
    found = getattr(module, attribute)
    if callable(found) and not isinstance(found, ModelSpec):
        try:
            found = found()
        except Exception as err:  # as above: the factory is the user's code
            raise _error(name, f"calling {attribute}() failed: {_first_line(err)}") from None
    if not isinstance(found, ModelSpec):
        raise _error(name, f"{attribute} is of type {type(found).__name__}, not a trainer.models.ModelSpec "
                           "(or a function of no arguments returning one)")
    return found


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _error(name: str, what: str) -> ConfigError:
    return ConfigError(f"--model={name}: {what}")
