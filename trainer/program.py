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
from trainer import code as code_lib, computation as computation_lib, data, model_config, models
from trainer import state as state_lib, step as step_lib
from trainer.config import (ConfigError, TrainConfig, check_mesh, check_training_fields, resolve_data_flag,
                            validate_workdir)

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
    module, codec, init = _module_and_init(config, spec)
    abstract = jax.eval_shape(init)
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


def _module_and_init(config: TrainConfig, spec: models.ModelSpec):
    """(module, codec, init): what the init and the step are built from. The init's abstract trace (done by
    each caller) teaches the codec the model state's keys, which the step's trace decodes."""
    module = spec.make_module(config)
    codec = state_lib.KeyCodec()
    return module, codec, state_lib.make_init_fn(config, spec, module, state_lib.make_optimizer(config, spec), codec)


# config -> its computation, kept from validate's abstract trace (check_model), so that the start-up's code
# identity traces nothing again (a config is frozen; a process's code does not change while it runs).
_COMPUTATIONS: dict[TrainConfig, dict[str, str]] = {}
_KEPT = 16  # configs: a verifier builds a run's program on a few meshes


def computation(config: TrainConfig) -> dict[str, str]:
    """The identity of what computes `config`'s numbers (trainer/computation.py): {"init", "step", "batch"}:
    sha256s of the jaxprs of the init, the step (loss, gradients, optimizer update and schedule, at the
    config's matmul precision) and the synthetic batch of a traced step number, each built by the functions
    build_program jits, traced on unsharded abstract inputs so that the mesh, the process count and the
    platform do not enter (a sharded trace has the layout's reshards in it). Record files' batches are read,
    not computed: "records" (their rows are the dataset's identity, a fixed field of every manifest).
    Traced once per config and process: validate's check_model keeps it."""
    try:
        kept = _COMPUTATIONS.get(config)
    except TypeError:  # a spec field holding an unhashable value: traced again, never shared by mistake
        kept = None
    return dict(kept if kept is not None else _trace(config, models.resolve(config.model))[0])


def _trace(config: TrainConfig, spec: models.ModelSpec):
    """(computation, abstract state, abstract output of the step): one abstract trace of the init, the batch
    and the step, what check_model checks and `computation` records."""
    module, codec, init = _module_and_init(config, spec)
    precision = config.matmul_precision
    init_digest, abstract = computation_lib.digest(at_precision(init, precision), return_shape=True)
    step_number = jax.ShapeDtypeStruct((), jax.numpy.int32)
    draw = at_precision(functools.partial(data.synthetic_batch, spec, config), precision)
    batch_digest, batch = computation_lib.digest(draw, step_number, return_shape=True)
    step = at_precision(make_step(config, spec, module, codec), precision)
    step_digest, out = computation_lib.digest(step, computation_lib.unsharded(abstract),
                                              computation_lib.unsharded(batch), return_shape=True)
    traced = {"init": init_digest, "step": step_digest,
              "batch": "records" if config.data != data.SYNTHETIC else batch_digest}
    if len(_COMPUTATIONS) >= _KEPT:
        _COMPUTATIONS.clear()
    try:
        _COMPUTATIONS[config] = traced
    except TypeError:  # unhashable (above): not kept
        pass
    return traced, abstract, out


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
    returns the model state it was given. ConfigError naming what is wrong. Its trace is the config's
    computation, kept for `computation`."""
    models.check_module(spec, spec.make_module(config))
    _, abstract, (new_state, *_) = _trace(config, spec)
    out = new_state.model_state
    if jax.tree.structure(out) != jax.tree.structure(abstract.model_state) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(abstract.model_state))):
        raise ConfigError(f"model {spec.name!r}: its loss returns model state {sorted(dict(out))} unlike the "
                          f"init's {sorted(dict(abstract.model_state))} (same collections, shapes and dtypes "
                          "are needed to carry it)")


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
    return dataclasses.replace(build_program(recorded, mesh, inputs),
                               code=code_lib.identity(recorded, computation(recorded)))


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
    if check_workdir:  # the run's own start-up: every path flag resolved once, recorded absolute
        config = dataclasses.replace(config, workdir=resolve_path(config.workdir, "--workdir"),
                                     data=resolve_data_flag(config.data, "--data"),
                                     eval_data=resolve_data_flag(config.eval_data, "--eval_data"))
        validate_workdir(config.workdir)
    expand_local_dir(config.checkpoint.local_dir, 0)  # a mistyped placeholder is bad input
    check_model(config, spec)  # abstractly: collections, loss, optimizer, nnx
    return config
