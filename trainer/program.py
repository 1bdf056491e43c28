"""Everything one config compiles on one mesh: the trainer and the verifier each build one.

One owner for the compiled pieces: the init, the donated step and the batch function, with
the state shardings they agree on and the abstract state a restore targets. The model comes
from its spec (trainer.models.resolve(config.model)); nothing here knows which one it is.
A Program is the replay program the verifier needs (verifier/program.py's protocol), and
`replay_program` is how the verifier builds one from a manifest's config on its own mesh. The init and
the step are traced at the config's --matmul_precision whatever the calling thread's setting, so a
verifier replays each run at the precision it recorded. `validate` checks a config against its model
and the devices before anything is written; it lives here because it ends with check_model, an
abstract trace of the model's init and step.
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpointing.config import check_fields, resolve_path
from checkpointing.inspection import expand_local_dir
from runtime import mesh as mesh_lib
from trainer import code as code_lib, data, model_config, models, state as state_lib, step as step_lib
from trainer.config import ConfigError, TrainConfig, check_mesh, check_training_fields, validate_workdir

REPLAY_PROGRAM = "trainer.program:replay_program"  # what every manifest of the trainer names


def build_mesh(config: TrainConfig, devices=None) -> Mesh:
    """The ('data', 'model') mesh of the config over all (or the given) devices."""
    return mesh_lib.build(config.mesh_shape(), devices)


@dataclasses.dataclass(frozen=True)
class Program:
    config: TrainConfig
    mesh: Mesh
    abstract_state: state_lib.TrainState  # ShapeDtypeStructs carrying this mesh's shardings.
    state_shardings: state_lib.TrainState
    batch_sharding: NamedSharding
    init_fn: Callable[[], state_lib.TrainState]
    step_fn: step_lib.StepFn  # (state, batch) -> (state, loss); .with_scalars adds {name: scalar}
    batch_fn: Callable[[int], Any]
    loss_rtol: float  # the model's measured cross-layout tolerances (its spec's)
    state_rtol: float
    init_loss_rtol: float | None = None  # the same for an interval replayed from the init (None: the above)
    init_state_rtol: float | None = None
    abstract_batch: Any = None  # the global batch as ShapeDtypeStructs (batch_sharding)
    loss_fn: Callable | None = None  # (params, batch) -> scalar loss, unjitted: the eval's
    inputs: data.Inputs | None = None  # the record files of --data/--eval_data (None: synthetic)
    code: dict | None = None  # the verifier's: the code identity this process replays with (trainer/code.py)


def build_program(config: TrainConfig, mesh: Mesh, inputs: data.Inputs | None = None) -> Program:
    """The program of `config` on `mesh`. `inputs`: the record files already opened (the trainer opens
    them before its Checkpointer, so bad files change nothing); else they are opened here."""
    spec = models.resolve(config.model)
    if inputs is None:
        inputs = data.open_inputs(spec, config, mesh)
    module, tx, codec, init, abstract = _model_pieces(config, spec)
    shardings = state_lib.state_shardings(abstract, mesh, spec.partition)
    batch_sharding = data.batch_sharding(mesh)
    # The position is the step either way: records (trainer/input) or the spec's synthetic draw.
    batch_fn = inputs.batches if inputs.batches is not None else data.make_batch_fn(spec, config, mesh)
    replicated = NamedSharding(mesh, P())
    # Shardings at the step's boundary: the state comes in and goes out with the same layout
    # (so it can be donated and the next call hits the same executable), the batch is split
    # over 'data', and the scalar loss is replicated so any process can read it.
    # The scalars (gradient and parameter norms, learning rate) come out replicated too.
    step = at_precision(make_step(config, spec, module, codec), config.matmul_precision)
    step_fn = step_lib.StepFn(jax.jit(
        step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated, replicated),
        donate_argnums=0,
    ))
    return Program(
        config=config,
        mesh=mesh,
        abstract_state=state_lib.with_shardings(abstract, shardings),
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        init_fn=jax.jit(at_precision(init, config.matmul_precision), out_shardings=shardings),
        step_fn=step_fn,
        batch_fn=batch_fn,
        loss_rtol=spec.tolerances_of(config)[0],
        state_rtol=spec.tolerances_of(config)[1],
        init_loss_rtol=spec.init_tolerances_of(config)[0],
        init_state_rtol=spec.init_tolerances_of(config)[1],
        abstract_batch=data.abstract_batch(batch_fn, batch_sharding),
        # The eval's loss: (params, batch) -> scalar, for specs whose loss takes no model state.
        loss_fn=None if spec.takes_model_state else functools.partial(spec.loss, module),
        inputs=inputs,
    )


def make_step(config: TrainConfig, spec: models.ModelSpec, module, codec: state_lib.KeyCodec):
    """(state, batch) -> (state, loss, scalars): the step of trainer/step.py with this run's pieces."""
    return functools.partial(step_lib.train_step, functools.partial(spec.loss, module), spec.takes_model_state,
                             codec, functools.partial(data.step_rng, config),
                             state_lib.step_learning_rate(config, spec))


def jax_precision(matmul_precision: str) -> str | None:
    """jax_default_matmul_precision's value for a --matmul_precision: None at the default, as in a process
    that never set it (the same HLO as before the flag existed)."""
    return None if matmul_precision == "default" else matmul_precision


def at_precision(fn: Callable, matmul_precision: str) -> Callable:
    """`fn` traced at `matmul_precision`: every dot it computes carries that precision in its HLO, whichever
    precision the thread that compiles it has set (the verifier proves runs of several in one process)."""
    precision = jax_precision(matmul_precision)

    @functools.wraps(fn)
    def traced(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    traced.__name__ = _name(fn)  # jit names its executables (and compilation cache entries) after it
    return traced


def _name(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", "fn")


def check_model(config: TrainConfig, spec: models.ModelSpec) -> None:
    """What a run needs of its model, checked abstractly (no compile, no device work) before anything is
    written: a module the trainer runs (not nnx), an optimizer, collections it can carry, and a loss that
    returns the model state it was given. ConfigError naming what is wrong.

    It traces the init and, where the loss carries model state, the loss's forward pass alone (the model state
    it returns is the step's); build_program then reuses the init's trace for the same config (_model_pieces):
    the whole step traced here again cost a TPU v5e's restart 2.9 s of its open (docs/performance.md)."""
    module, _, codec, _, abstract = _model_pieces(config, spec, checking=True)
    if not spec.takes_model_state:
        return  # the step carries the init's model state through unchanged (trainer/step.py)
    batch = jax.eval_shape(lambda: data.synthetic_batch(spec, config, jax.numpy.zeros((), jax.numpy.int32)))

    def model_state_out(state, batch):  # what train_step's objective returns as its model state
        _, model_state = spec.loss(module, state.params, codec.decode(state.model_state), batch,
                                   data.step_rng(config, state.step))
        return codec.encode(model_state)

    out = jax.eval_shape(model_state_out, abstract, batch)
    if jax.tree.structure(out) != jax.tree.structure(abstract.model_state) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(abstract.model_state))):
        raise ConfigError(f"model {spec.name!r}: its loss returns model state {sorted(dict(out))} unlike the "
                          f"init's {sorted(dict(abstract.model_state))} (same collections, shapes and dtypes "
                          "are needed to carry it)")


# The model's pieces that check_model last made, for build_program of the same config and spec: (config, spec,
# (module, tx, codec, init, abstract state)). One entry: a start-up checks one config, then builds its program.
_CHECKED: list[tuple] = []


def _model_pieces(config: TrainConfig, spec: models.ModelSpec, checking: bool = False) -> tuple:
    """(module, optimizer, KeyCodec, init, jax.eval_shape(init)): made and traced once for a config and spec
    that check_model checked (the codec learns the init's keys while it is traced, so the pieces go together)."""
    for checked_config, checked_spec, pieces in list(_CHECKED):
        if checked_spec is spec and checked_config == config:
            return pieces
    module = spec.make_module(config)
    if checking:
        models.check_module(spec, module)
    tx = state_lib.make_optimizer(config, spec)
    codec = state_lib.KeyCodec()
    init = state_lib.make_init_fn(config, spec, module, tx, codec)
    pieces = (module, tx, codec, init, jax.eval_shape(init))
    if checking:
        _CHECKED[:] = [(config, spec, pieces)]
    return pieces


def replay_program(config: dict, mesh: Mesh) -> Program:
    """The program of a run whose manifest recorded `config` (TrainConfig.to_json), on `mesh`: the
    verifier's. ConfigError names a field the recorded config cannot hold; DatasetChangedError the
    file or field of the recorded dataset identity that the files on disk no longer match."""
    fields = {k: v for k, v in config.items() if k not in data.RECORDED_KEYS}
    recorded = model_config.from_json({**fields, "mesh": dict(mesh.shape)})
    recorded = validate(model_config.replace(recorded, resume_from="latest", init_from=""), mesh.devices.size,
                        check_workdir=False)
    # Replay reads only the train split: the eval batches are not part of a step.
    inputs = data.open_inputs(models.resolve(recorded.model),
                              model_config.replace(recorded, eval_data="", eval_every_steps=0), mesh)
    data.check_recorded(config, inputs, "recorded in the manifest")
    return dataclasses.replace(build_program(recorded, mesh, inputs), code=code_lib.identity(recorded))


def validate(config: TrainConfig, device_count: int, *, check_workdir: bool = True) -> TrainConfig:
    """Checks the config against itself, its model and the visible devices; returns it with the mesh
    filled in and --save_every_secs parsed.

    A reader of someone else's workdir (the verifier) passes check_workdir=False: it must not probe it.
    """
    check_fields(config)
    config = dataclasses.replace(config, checkpoint=config.checkpoint.validated())
    spec = models.resolve(config.model)
    config = check_training_fields(config, spec)
    spec.check_config(config)
    if config.eval_every_steps and not config.eval_data:  # refused before anything is written, as every check
        raise ConfigError(f"--eval_every_steps={config.eval_every_steps} needs --eval_data=records:<glob>")
    if config.eval_every_steps and spec.takes_model_state:
        raise ConfigError(f"--eval_every_steps={config.eval_every_steps}: the model's loss carries model state "
                          "(BatchNorm, dropout); evaluation supports losses of (params, batch) only")
    if not config.mesh:
        config = dataclasses.replace(config, mesh=(("data", device_count),))
    check_mesh(config.mesh, device_count)
    sizes = config.mesh_shape()
    if config.batch_size % sizes["data"]:
        raise ConfigError(
            f"--batch_size={config.batch_size} is not divisible by the data axis ({sizes['data']})"
        )
    if check_workdir:
        config = dataclasses.replace(config, workdir=resolve_path(config.workdir, "--workdir"))
        validate_workdir(config.workdir)
    expand_local_dir(config.checkpoint.local_dir, 0)  # a mistyped placeholder is bad input
    check_model(config, spec)  # abstractly: collections, loss, optimizer, nnx
    return config
