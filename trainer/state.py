"""The train state: one pytree of params, both Adam moments and a strong int32 step.

Built as eval_shape(init) -> shardings -> jit(init, out_shardings=...), and `abstract_state`
is the same tree of ShapeDtypeStructs with the current mesh's shardings: it is what a restore
uses as its target, so a checkpoint always comes back laid out for the mesh that reads it.

Sharding rule: one rule for every leaf, decided by shape alone, so a param and its two Adam
moments always share a layout. It is the model spec's `partition` hint, by default
(trainer.models.default_partition): a leaf with two or more dimensions is split over 'model' along
its last dimension if the 'model' size divides it, else along its first; anything else (biases,
scalars, the step, Adam's count, shapes 'model' does not divide) is replicated.
"""

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from trainer.config import TrainConfig
from trainer.models import ModelSpec, default_partition

TrainState = train_state.TrainState


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.adam(config.learning_rate)


def init_key(config: TrainConfig) -> jax.Array:
    return jax.random.fold_in(jax.random.key(config.seed), 0)


def make_init_fn(config: TrainConfig, spec: ModelSpec, module, tx):
    """() -> TrainState. Pure, so eval_shape and jit see the same function."""
    # The module is traced with zeros shaped like one batch: the init depends on the key alone.
    batch_shapes = jax.eval_shape(lambda: spec.synthetic_batch(config, jax.random.key(0)))

    def init() -> TrainState:
        example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), batch_shapes)
        params = module.init(init_key(config), spec.init_inputs(example))["params"]
        state = TrainState.create(apply_fn=module.apply, params=params, tx=tx)
        # TrainState.create leaves step as the Python int 0 (weak-typed); a restored step is a
        # strong int32, and the mix would compile the step twice more.
        return state.replace(step=jnp.zeros((), jnp.int32))

    return init


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
