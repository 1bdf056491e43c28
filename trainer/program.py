"""Everything one config compiles on one mesh: the trainer and the verifier each build one.

One owner for the compiled pieces: the init, the donated step and the batch function, with
the state shardings they agree on and the abstract state a restore targets. The model comes
from its spec (trainer.models.resolve(config.model)); nothing here knows which one it is.
A Program is the replay program the verifier needs (verifier/program.py's protocol), and
`replay_program` is how the verifier builds one from a manifest's config on its own mesh.
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from trainer import data, models, state as state_lib, step as step_lib
from trainer.config import MESH_AXES, TrainConfig, validate

REPLAY_PROGRAM = "trainer.program:replay_program"  # what every manifest of the trainer names


def build_mesh(config: TrainConfig, devices=None) -> Mesh:
    """The ('data', 'model') mesh of the config over all (or the given) devices."""
    sizes = config.mesh_shape()
    # Auto axes: shardings are given explicitly at the jit boundaries and XLA partitions inside.
    return jax.make_mesh(tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


@dataclasses.dataclass(frozen=True)
class Program:
    config: TrainConfig
    mesh: Mesh
    abstract_state: state_lib.TrainState  # ShapeDtypeStructs carrying this mesh's shardings.
    state_shardings: state_lib.TrainState
    batch_sharding: NamedSharding
    init_fn: Callable[[], state_lib.TrainState]
    step_fn: Callable[[state_lib.TrainState, Any], tuple[state_lib.TrainState, jax.Array]]
    batch_fn: Callable[[int], Any]
    loss_rtol: float  # the model's measured cross-layout tolerances (its spec's)
    state_rtol: float
    abstract_batch: Any = None  # the global batch as ShapeDtypeStructs (batch_sharding)
    loss_fn: Callable | None = None  # (params, batch) -> scalar loss, unjitted: the eval's
    inputs: data.Inputs | None = None  # the record files of --data/--eval_data (None: synthetic)


def build_program(config: TrainConfig, mesh: Mesh, inputs: data.Inputs | None = None) -> Program:
    """The program of `config` on `mesh`. `inputs`: the record files already opened (the trainer opens
    them before its Checkpointer, so bad files change nothing); else they are opened here."""
    spec = models.resolve(config.model)
    if inputs is None:
        inputs = data.open_inputs(spec, config, mesh)
    module = spec.make_module(config)
    tx = state_lib.make_optimizer(config)
    init = state_lib.make_init_fn(config, spec, module, tx)
    abstract = jax.eval_shape(init)
    shardings = state_lib.state_shardings(abstract, mesh, spec.partition)
    batch_sharding = data.batch_sharding(mesh)
    # The position is the step either way: records (trainer/input) or the spec's synthetic draw.
    batch_fn = inputs.batches if inputs.batches is not None else data.make_batch_fn(spec, config, mesh)
    replicated = NamedSharding(mesh, P())
    # Shardings at the step's boundary: the state comes in and goes out with the same layout
    # (so it can be donated and the next call hits the same executable), the batch is split
    # over 'data', and the scalar loss is replicated so any process can read it.
    step_fn = jax.jit(
        functools.partial(step_lib.train_step, functools.partial(spec.loss, module)),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    return Program(
        config=config,
        mesh=mesh,
        abstract_state=state_lib.with_shardings(abstract, shardings),
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        init_fn=jax.jit(init, out_shardings=shardings),
        step_fn=step_fn,
        batch_fn=batch_fn,
        loss_rtol=spec.cross_mesh_loss_rtol,
        state_rtol=spec.cross_mesh_state_rtol,
        abstract_batch=data.abstract_batch(batch_fn, batch_sharding),
        loss_fn=functools.partial(spec.loss, module),
        inputs=inputs,
    )


def replay_program(config: dict, mesh: Mesh) -> Program:
    """The program of a run whose manifest recorded `config` (TrainConfig.to_json), on `mesh`: the
    verifier's. ConfigError names a field the recorded config cannot hold; DatasetChangedError the
    file or field of the recorded dataset identity that the files on disk no longer match."""
    fields = {k: v for k, v in config.items() if k not in data.RECORDED_KEYS}
    recorded = TrainConfig.from_json({**fields, "mesh": dict(mesh.shape)})
    recorded = validate(recorded.replace(resume_from="latest", init_from=""), mesh.devices.size, check_workdir=False)
    # Replay reads only the train split: the eval batches are not part of a step.
    inputs = data.open_inputs(models.resolve(recorded.model), recorded.replace(eval_data="", eval_every_steps=0), mesh)
    data.check_recorded(config, inputs, "recorded in the manifest")
    return build_program(recorded, mesh, inputs)
