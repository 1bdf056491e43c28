"""The train state: one pytree of params, the whole optimizer state, the model's own state and a
strong int32 step.

Built as eval_shape(init) -> shardings -> jit(init, out_shardings=...), and `abstract_state`
is the same tree of ShapeDtypeStructs with the current mesh's shardings: it is what a restore
uses as its target, so a checkpoint always comes back laid out for the mesh that reads it.

`model_state` is every collection the module's init returned besides params (BatchNorm's
batch_stats, any mutable collection): saved, fingerprinted and restored with the rest. A typed PRNG
key in it is stored as its key_data (uint32 words, seed 003) and handed to the loss wrapped again.
A collection the trainer cannot carry (the spec's loss cannot return it, or it holds something that
is not an array) is refused by name when the program is built, never dropped.

Sharding rule: one rule for every leaf, decided by shape alone, so a param, its Adam moments and its
accumulated gradient always share a layout. It is the model spec's `partition` hint, by default
(trainer.models.default_partition): a leaf with two or more dimensions is split over 'model' along
its last dimension if the 'model' size divides it, else along its first; anything else (biases,
scalars, the step, Adam's count, shapes 'model' does not divide) is replicated.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from trainer.config import ConfigError, TrainConfig
from trainer.models import ModelSpec, default_partition


class TrainState(train_state.TrainState):
    """flax's TrainState (step, params, opt_state) and the model's own collections."""

    model_state: Any = struct.field(default_factory=dict)


def learning_rate_fn(config: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """Optimizer update count -> learning rate, per --lr_schedule."""
    if config.lr_schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                                  config.lr_decay_steps, end_value=0.0)
    return optax.constant_schedule(config.learning_rate)


def make_optimizer(config: TrainConfig, spec: ModelSpec | None = None) -> optax.GradientTransformation:
    """The spec's own optimizer if it has one, else the flags': --optimizer with --lr_schedule, then
    global-norm clipping before it and gradient accumulation (optax.MultiSteps) around it."""
    if spec is not None and spec.make_optimizer is not None:
        tx = spec.make_optimizer(config)
        if not isinstance(tx, optax.GradientTransformation):
            raise ConfigError(f"model {spec.name!r}: make_optimizer returned {type(tx).__name__}, "
                              "not an optax.GradientTransformation")
        return tx
    schedule = learning_rate_fn(config)
    if config.optimizer == "adamw":
        tx = optax.adamw(schedule, weight_decay=config.weight_decay)
    else:
        tx = optax.adam(schedule)
    if config.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
    if config.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=config.grad_accum_steps).gradient_transformation()
    return tx


def step_learning_rate(config: TrainConfig, spec: ModelSpec) -> Callable[[jax.Array], jax.Array] | None:
    """Step -> the learning rate that step's update uses (None: the spec's own optimizer, unknown)."""
    if spec.make_optimizer is not None:
        return None
    schedule = learning_rate_fn(config)
    return lambda step: schedule(step // config.grad_accum_steps)


def init_key(config: TrainConfig) -> jax.Array:
    return jax.random.fold_in(jax.random.key(config.seed), 0)


class KeyCodec:
    """Typed PRNG keys in the model state <-> their key_data, by key path (found while tracing the init)."""

    def __init__(self):
        self.impls: dict[str, Any] = {}

    def learn(self, tree) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                self.impls[jax.tree_util.keystr(path)] = jax.random.key_impl(leaf)

    def encode(self, tree):
        return jax.tree.map(lambda leaf: jax.random.key_data(leaf)
                            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf, tree)

    def decode(self, tree):
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.random.wrap_key_data(leaf, impl=self.impls[key])
            if (key := jax.tree_util.keystr(path)) in self.impls else leaf, tree)


def make_init_fn(config: TrainConfig, spec: ModelSpec, module, tx, codec: KeyCodec | None = None):
    """() -> TrainState. Pure, so eval_shape and jit see the same function."""
    # The module is traced with zeros shaped like one batch: the init depends on the key alone.
    batch_shapes = jax.eval_shape(lambda: spec.synthetic_batch(config, jax.random.key(0)))
    codec = codec or KeyCodec()

    def init() -> TrainState:
        example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), batch_shapes)
        variables = dict(module.init(init_key(config), spec.init_inputs(example)))
        params = variables.pop("params")
        check_collections(spec, variables)
        codec.learn(variables)
        state = TrainState.create(apply_fn=module.apply, params=params, tx=tx, model_state=codec.encode(variables))
        # TrainState.create leaves step as the Python int 0 (weak-typed); a restored step is a
        # strong int32, and the mix would compile the step twice more.
        return state.replace(step=jnp.zeros((), jnp.int32))

    return init


def check_collections(spec: ModelSpec, collections: dict) -> None:
    """A ConfigError naming a collection the trainer cannot carry: one the older 3-argument loss cannot
    return updated, or one holding something other than arrays."""
    if collections and not spec.takes_model_state:
        raise ConfigError(f"model {spec.name!r}: its init returns collection(s) {', '.join(sorted(collections))} "
                          "that loss(module, params, batch) cannot carry; write loss(module, params, model_state, "
                          "batch, rng) -> (loss, new_model_state) (docs/training.md)")
    for name, tree in collections.items():
        if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree)):
            raise ConfigError(f"model {spec.name!r}: collection {name!r} holds values that are not arrays; "
                              "the trainer cannot carry it")


def state_shardings(abstract: TrainState, mesh: Mesh, partition=default_partition) -> TrainState:
    """NamedSharding for every leaf of the state, by the rule in the module docstring."""
    model_size = mesh.shape["model"]
    return jax.tree.map(lambda leaf: NamedSharding(mesh, partition(leaf.shape, model_size)), abstract)


def with_shardings(abstract: TrainState, shardings: TrainState) -> TrainState:
    """The abstract state with each leaf's sharding attached: a restore target."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract, shardings,
    )
