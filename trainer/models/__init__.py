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
- the tolerances are measured (`python -m verifier.calibrate`; `load_tolerances` reads its file,
  trainer/models/measured.py): one pair for an interval replayed from a saved step, and optionally
  (`init_tolerances`) a looser one for the first interval, replayed from the init.

The loss is `loss(module, params, model_state, batch, rng) -> (loss, new_model_state)`: model_state
holds every collection the init returned besides params (BatchNorm's batch_stats), rng is the step's
own key (trainer/data.py's step_rng: fold_in of the seed and the step, never state). The older
`loss(module, params, batch) -> loss` still works for a model whose init returns params alone.
A spec may declare its own config fields (`fields`: ModelField, each a flag --<name>, validated,
recorded in every manifest, hashed when fixed) and its own optimizer (`make_optimizer`).
"""

import dataclasses
import importlib
import inspect
import sys
from typing import Any, Callable

from jax.sharding import PartitionSpec as P

from checkpointing import CheckpointConfig
from trainer.config import ConfigError, TrainConfig
from trainer.models.measured import StateTolerance, load_tolerances  # noqa: F401 (the spec's API)

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


FIELD_TYPES = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class ModelField:
    """One of a spec's own config fields: the flag --<name>, validated, recorded in every manifest,
    and (fixed=True) hashed with the fields a resume must not change."""

    name: str
    type: type  # bool, int, float or str
    default: Any
    help: str
    minimum: float | None = None  # inclusive bounds of a number
    maximum: float | None = None
    choices: tuple = ()  # the values a str (or number) may take; () any
    fixed: bool = True  # a resume may not change it (it changes the numbers)

    def __post_init__(self):
        if self.type not in FIELD_TYPES:
            raise ConfigError(f"model field {self.name!r}: type must be one of bool, int, float, str")
        if not self.name.isidentifier():
            raise ConfigError(f"model field {self.name!r}: not a valid flag name")
        self.check(self.default)

    def check(self, value) -> None:
        """A ConfigError naming --<name> unless `value` has the field's type, choices and bounds."""
        ok_type = isinstance(value, self.type) and (self.type is bool or not isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok_type = True
        if not ok_type:
            raise ConfigError(f"--{self.name}={value!r}: must be of type {self.type.__name__}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"--{self.name}={value}: must be one of {', '.join(map(str, self.choices))}")
        if self.type in (int, float):
            if not (value == value and abs(value) != float("inf")):
                raise ConfigError(f"--{self.name} must be a finite number, got {value}")
            if self.minimum is not None and not value >= self.minimum:
                raise ConfigError(f"--{self.name} must be >= {self.minimum}, got {value}")
            if self.maximum is not None and not value <= self.maximum:
                raise ConfigError(f"--{self.name} must be <= {self.maximum}, got {value}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model: how to build it, train it, feed it and how far two meshes may disagree on it."""

    name: str  # Shown in logs; the config records the --model value it was resolved from.
    make_module: Callable[[TrainConfig], Any]  # config -> flax module.
    loss: Callable[[Any, Any, dict], Any]  # (module, params, batch) -> scalar loss of the batch.
    synthetic_batch: Callable[[TrainConfig, Any], dict]  # (config, key) -> {name: global array}.
    init_inputs: Callable[[dict], Any]  # batch -> what module.init is traced with (zeros of its shape).
    # Optional, and floors at most: the verifier measures the noise of a layout change for each interval
    # (verifier/evidence.py) and fails a step only beyond a margin over it; a declared bound can only loosen that.
    # The largest relative difference per step between two loss lists of the same run on two meshes (0: none).
    cross_mesh_loss_rtol: float = 0.0
    # Per leaf: ||replayed - saved|| <= rtol * max(||replayed||, movement) (verifier/tolerances.py; 0: none).
    cross_mesh_state_rtol: float = 0.0
    check_config: Callable[[TrainConfig], None] = accept_any_config  # raises ConfigError naming the flag.
    partition: Callable[[tuple[int, ...], int], P] = default_partition  # (shape, model size) -> layout.
    fields: tuple[ModelField, ...] = ()  # the spec's own config fields (flags --<name>)
    # config -> optax.GradientTransformation, replacing the one the trainer's flags build (None: those).
    make_optimizer: Callable[[TrainConfig], Any] | None = None
    # config -> (loss rtol, state rtol) where they depend on the config (bf16 compute); None: the two above.
    tolerances: Callable[[TrainConfig], tuple[float, float]] | None = None
    # config -> (loss rtol, state rtol) of an interval replayed from the init, a full proof's first
    # (Adam's first update, g/|g|, makes it drift far more); None: tolerances_of's.
    init_tolerances: Callable[[TrainConfig], tuple[float, float]] | None = None

    def tolerances_of(self, config: TrainConfig) -> tuple[float, float]:
        if self.tolerances is None:
            return self.cross_mesh_loss_rtol, self.cross_mesh_state_rtol
        return tuple(self.tolerances(config))

    def init_tolerances_of(self, config: TrainConfig) -> tuple[float, float]:
        """(loss rtol, state rtol) across layouts for an interval replayed from the config's init."""
        if self.init_tolerances is None:
            return self.tolerances_of(config)
        return tuple(self.init_tolerances(config))

    @property
    def takes_model_state(self) -> bool:
        """Whether the loss is loss(module, params, model_state, batch, rng) -> (loss, model_state);
        else the older loss(module, params, batch) -> loss."""
        try:
            parameters = inspect.signature(self.loss).parameters.values()
        except (TypeError, ValueError):
            return True
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return len(positional) != 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)

    def __post_init__(self):
        for field in ("make_optimizer", "tolerances", "init_tolerances"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ConfigError(f"model {self.name!r}: {field} must be callable")
        taken = {f.name for f in dataclasses.fields(TrainConfig)} | _checkpoint_names() | {"code"}
        names = [f.name for f in self.fields]
        for field in self.fields:
            if not isinstance(field, ModelField):
                raise ConfigError(f"model {self.name!r}: fields must be trainer.models.ModelField")
            if field.name in taken or names.count(field.name) > 1:
                raise ConfigError(f"model {self.name!r}: field {field.name!r} is taken by the trainer or given twice")
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
    if is_nnx(found):
        raise _error(name, NNX_HINT.format(what=attribute))
    if callable(found) and not isinstance(found, ModelSpec):
        try:
            found = found()
        except Exception as err:  # as above: the factory is the user's code
            raise _error(name, f"calling {attribute}() failed: {_first_line(err)}") from None
    if not isinstance(found, ModelSpec):
        raise _error(name, f"{attribute} is of type {type(found).__name__}, not a trainer.models.ModelSpec "
                           "(or a function of no arguments returning one)")
    return found


NNX_HINT = ("{what} is a flax.nnx Module; the trainer runs flax.linen modules: wrap it with "
            "flax.nnx.bridge.ToLinen in a ModelSpec's make_module (docs/training.md)")


def is_nnx(value) -> bool:
    """Whether `value` is a flax.nnx Module (an instance or a class)."""
    # Nothing is an nnx Module before flax.nnx is imported, and importing it costs every start about 0.3 s.
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    return isinstance(value, nnx.Module) or (isinstance(value, type) and issubclass(value, nnx.Module))


def check_module(spec: ModelSpec, module) -> None:
    """A ConfigError when make_module returned something the trainer cannot run (an nnx Module)."""
    if is_nnx(module):
        raise ConfigError(f"model {spec.name!r}: make_module returned "
                          + NNX_HINT.format(what=type(module).__name__))


def _checkpoint_names() -> set[str]:
    return {f.name for f in dataclasses.fields(CheckpointConfig)}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _error(name: str, what: str) -> ConfigError:
    return ConfigError(f"--model={name}: {what}")
