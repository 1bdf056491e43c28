"""The run's configuration: one frozen object built once from flags.

Every field carries its flag help and bounds as metadata (`checkpointing.config.option`):
trainer/flags.py generates the flags from it and `trainer.program.validate` checks it, so each is
written once. The checkpoint fields are checkpointing's own `CheckpointConfig`, composed as
`config.checkpoint`; flags, manifests and `trainer.model_config.from_flat` see one flat namespace
(`--save_every_steps`, not a nested name). `FIXED_FIELDS` are the fields a resume must not change (they
decide the state's shapes or the numbers the run computes); the manifest stores a hash of them and a
resume that changes one is refused.

A leaf: it knows the fields and their parsing only. What needs the model registry (a spec's own
fields, its checks) is above it, in trainer/model_config.py and trainer/program.py, since the
registry itself needs TrainConfig. It imports no JAX (the trainer holds SIGTERM before JAX loads).
"""

import dataclasses
import os
import tempfile

from checkpointing import CheckpointConfig, ConfigError
from checkpointing.config import is_object_store, option
from runtime import mesh as mesh_lib

MESH_AXES = mesh_lib.AXES


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    workdir: str = option("", "Checkpoints, verdicts and metrics live here (local path, gs:// or s3://).")
    model: str = option("mlp", "mlp, transformer, or your own: package.module:name naming a "
                               "trainer.models.ModelSpec (docs/training.md).")
    steps: int = option(100, "Total optimizer steps of the run; a resume continues up to this step.", minimum=1)
    mesh: tuple[tuple[str, int], ...] = option(
        (), "Axis sizes by name, e.g. data=4,model=2; a missing axis is 1; the product must equal the "
            "device count. Empty: data=<all devices>.")
    batch_size: int = option(64, "Global batch, split over the 'data' axis.", minimum=1)
    learning_rate: float = option(1e-2, "Adam step size.", positive=True)
    seed: int = option(0, "Base of every random draw: the init key and the fold_in(seed, step) batches.")
    log_every_steps: int = option(10, "Losses are pulled to the host (and logged) at this cadence.", minimum=1)
    input_dim: int = option(16, "mlp: features per example.", minimum=1)
    hidden_dim: int = option(64, "mlp: hidden width; transformer: model width (d_model).", minimum=1)
    num_layers: int = option(2, "mlp: hidden layers; transformer: decoder blocks.", minimum=1)
    num_heads: int = option(4, "transformer: attention heads (must divide --hidden_dim).", minimum=1)
    seq_len: int = option(32, "transformer: tokens per example.", minimum=1)
    vocab_size: int = option(64, "transformer: token vocabulary.", minimum=2)
    watchdog_secs: float = option(600.0, "Longest a step, restore or save may block before the process exits 1.",
                                  positive=True)
    # --- input data and evaluation (docs/data.md; trainer/data.py builds what they name) ---
    data: str = option("synthetic", "synthetic (the model's own batches) or records:<glob> of ArrayRecord files "
                                    "written by trainer.prepare (a local path).")
    eval_data: str = option("", "records:<glob> of the held-out split (prepare's eval-*.array_record); empty: none.")
    eval_every_steps: int = option(0, "Eval loss over --eval_batches of --eval_data every this many steps; 0: off.",
                                   minimum=0)
    eval_batches: int = option(4, "Eval batches: steps 0..k-1 of --eval_data in its own fixed order.", minimum=1)
    check_data: str = option("stat", "How a start-up takes the record files' content digests (sha256): stat "
                                     "(hash a file only where its size or mtime differs from prepare's "
                                     "metadata.json or this host's digest cache) or full (hash every file).")
    accept_data_change: bool = option(False, "Resume although the record files differ from the newest "
                                             "checkpoint's (their content, sizes or files); the manifests record "
                                             "the change. Else such a resume exits 2.")
    # --- the optimizer and the model's own fields (issue 19) ---
    optimizer: str = option("adam", "adam or adamw (decoupled --weight_decay); a spec's make_optimizer replaces it.")
    weight_decay: float = option(0.0, "adamw: decoupled weight decay (0 off).", minimum=0.0)
    lr_schedule: str = option("constant", "constant, or warmup_cosine: linear warmup over --warmup_steps to "
                                          "--learning_rate, then cosine decay to 0 at --lr_decay_steps.")
    warmup_steps: int = option(0, "warmup_cosine: optimizer updates of linear warmup.", minimum=0)
    lr_decay_steps: int = option(0, "warmup_cosine: updates until the rate reaches 0; 0: --steps divided by "
                                    "--grad_accum_steps, fixed when the run starts.", minimum=0)
    grad_clip_norm: float = option(0.0, "Clip gradients to this global norm before the update (0 off).",
                                   minimum=0.0)
    grad_accum_steps: int = option(1, "Accumulate gradients over this many steps per update (optax.MultiSteps; "
                                      "1 off); the accumulators are state.", minimum=1)
    matmul_precision: str = option("default", "Matmul precision of the whole run, as jax names it: default (the "
                                              "backend's own: bfloat16 passes on TPU), high, or highest (float32 "
                                              "matmuls everywhere; a TPU's exp and log still differ); bfloat16, "
                                              "tensorfloat32 and float32 name the same three. A resume may not "
                                              "change it.")
    refuse_code_change: bool = option(False, "Refuse (exit 2) to resume a run whose newest checkpoint was computed "
                                             "by another computation (the jaxpr of its init, step or batch; "
                                             "trainer/code.py); else warn.")
    # The model spec's own fields (trainer.models.ModelField) as ((name, value), ...), every one of the
    # spec's present; flags and manifests see them flat, like the checkpoint fields.
    model_fields: tuple = dataclasses.field(default=(), metadata={"help": "the model spec's own fields"})
    # --- end of the optimizer and model fields ---
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes by name, every axis of MESH_AXES present (a missing axis is 1)."""
        return mesh_lib.sizes(self.mesh)

    def to_json(self) -> dict:
        """Flat, as every manifest has recorded it: the checkpoint fields beside the others."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("checkpoint", "model_fields")}
        fields["mesh"] = dict(self.mesh)
        return {**fields, **dict(self.model_fields), **dataclasses.asdict(self.checkpoint)}

    def model_field(self, name: str):
        """The value of the model spec's own field `name` (trainer.models.ModelField)."""
        return dict(self.model_fields)[name]


# Fields that shape the state or the computed numbers; the mesh, step count, cadences and
# checkpoint policy may change between a run and its resume.
FIXED_FIELDS = (
    "model", "batch_size", "learning_rate", "seed", "input_dim", "hidden_dim", "num_layers",
    "num_heads", "seq_len", "vocab_size",
    "optimizer", "weight_decay", "lr_schedule", "warmup_steps", "lr_decay_steps", "grad_clip_norm",
    "grad_accum_steps",
)
# Fixed, but only at a value other than the default: it decides the numbers (a resume may not change it),
# and was added after runs were saved. Left out of the hash at its default, so such a run, whose
# fixed_fields lack it, hashes as before and resumes; set, it is in the hash and a resume that changes
# it is refused by name. Not a field to change mid-run like the mesh: the verifier replays a run at one
# precision, and a resume that dropped --matmul_precision=highest would quietly change its numbers.
FIXED_WHEN_SET = ("matmul_precision",)
CODE_FIELD = "code"  # the Checkpointer's config dict records what computed each manifest here (trainer/code.py)
OPTIMIZERS = ("adam", "adamw")
LR_SCHEDULES = ("constant", "warmup_cosine")
# --matmul_precision -> jax's name: jax takes the dtype names as aliases of the three.
MATMUL_PRECISIONS = {"default": "default", "high": "high", "highest": "highest",
                     "bfloat16": "default", "tensorfloat32": "high", "float32": "highest"}


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """Parses 'data=4,model=2' into (('data', 4), ('model', 2)); '' means 'all devices on data' (runtime/mesh.py)."""
    try:
        return mesh_lib.parse(text)
    except mesh_lib.MeshError as err:
        raise ConfigError(str(err)) from None


def check_training_fields(config: TrainConfig, spec) -> TrainConfig:
    """The optimizer's fields and the spec's own (type, choices, bounds); returns the config with
    --lr_decay_steps filled in. A ConfigError names the flag."""
    if config.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer={config.optimizer}: must be one of {', '.join(OPTIMIZERS)}")
    if config.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"--lr_schedule={config.lr_schedule}: must be one of {', '.join(LR_SCHEDULES)}")
    if config.matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError(f"--matmul_precision={config.matmul_precision}: must be one of "
                          f"{', '.join(MATMUL_PRECISIONS)}")
    config = dataclasses.replace(config, matmul_precision=MATMUL_PRECISIONS[config.matmul_precision])
    if config.weight_decay and config.optimizer != "adamw":
        raise ConfigError(f"--weight_decay={config.weight_decay} needs --optimizer=adamw")
    if config.lr_schedule == "warmup_cosine" and not config.lr_decay_steps:
        config = dataclasses.replace(config, lr_decay_steps=max(config.steps // config.grad_accum_steps, 1))
    if config.lr_schedule == "warmup_cosine" and config.warmup_steps >= config.lr_decay_steps:
        raise ConfigError(f"--warmup_steps={config.warmup_steps} must be below --lr_decay_steps="
                          f"{config.lr_decay_steps}")
    for field in spec.fields:
        field.check(config.model_field(field.name))
    return config


def check_mesh(mesh: tuple[tuple[str, int], ...], device_count: int) -> None:
    try:
        mesh_lib.check(mesh, device_count)
    except mesh_lib.MeshError as err:
        raise ConfigError(str(err)) from None


RECORDS_PREFIX = "records:"  # trainer/input/records.py's PREFIX, here so a synthetic run imports no Grain


def resolve_data_flag(value: str, flag: str) -> str:
    """--data/--eval_data as the manifests record them: `records:<glob>` with the glob's local path made
    absolute once (as --workdir: a verifier started in another directory reads the same files), '~'
    expanded, its wildcards kept; `synthetic`, empty, another scheme and a bad value unchanged (the data's
    own check names a bad one). Not resolve_path: a glob's wildcards are its point."""
    if not value.startswith(RECORDS_PREFIX):
        return value
    pattern = value[len(RECORDS_PREFIX):]
    if not pattern or "://" in pattern:
        return value
    return RECORDS_PREFIX + os.path.abspath(os.path.expanduser(pattern))


def validate_workdir(workdir: str) -> None:
    """A local workdir must be a writable directory, or missing with a writable directory as its
    nearest existing parent; gs:// and s3:// are checked on use. Nothing is created: the trainer makes the
    directory only once it holds the workdir (a refused run leaves nothing behind).
    """
    if not workdir:
        raise ConfigError("--workdir is required")
    if is_object_store(workdir):
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} exists and is not a directory")
    if not os.path.isdir(workdir):
        parent = os.path.dirname(os.path.abspath(workdir))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ConfigError(f"--workdir={workdir} is not writable: {parent} is not a directory")
        # access() is all a missing directory allows without creating something; it sees a
        # read-only file system and, for everyone but root, the permission bits.
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"--workdir={workdir} is not writable: cannot create it in {parent}")
        return
    try:
        # os.access lies for root; a real write is the only honest probe.
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"--workdir={workdir} is not writable: {err.strerror}") from None
