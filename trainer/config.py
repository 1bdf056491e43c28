"""The run's configuration: one frozen object built once from flags.

Every field has a one-line comment. `FIXED_FIELDS` are the fields a resume must not change
(they decide the state's shapes or the numbers the run computes); the checkpoint manifest
stores a hash of them and a resume with different values is refused.
"""

import dataclasses
import hashlib
import json
import os
import tempfile

MESH_AXES = ("data", "model")
MODELS = ("mlp", "transformer")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    workdir: str = ""  # Checkpoints, verdicts and metrics live here (local path or gs://).
    model: str = "mlp"  # 'mlp' (regression, as in the seeds) or 'transformer' (decoder-only LM).
    steps: int = 100  # Total optimizer steps of the run; a resume continues up to this step.
    mesh: tuple[tuple[str, int], ...] = ()  # Axis sizes by name; () means data=<all devices>.
    batch_size: int = 64  # Global batch, split over the 'data' axis.
    learning_rate: float = 1e-2  # Adam step size.
    seed: int = 0  # Base of every random draw: init key and the fold_in(seed, step) batches.
    log_every_steps: int = 10  # Losses are pulled to the host (and logged) at this cadence.
    input_dim: int = 16  # mlp: features per example.
    hidden_dim: int = 64  # mlp: hidden width; transformer: model width (d_model).
    num_layers: int = 2  # mlp: hidden layers; transformer: decoder blocks.
    num_heads: int = 4  # transformer: attention heads (must divide hidden_dim).
    seq_len: int = 32  # transformer: tokens per example.
    vocab_size: int = 64  # transformer: token vocabulary.
    # Checkpointing (see checkpointing.service.CheckpointOptions for the semantics).
    save_every_steps: int = 0  # Save when the step is a multiple of this; 0 disables.
    save_every_secs: float | str = 0.0  # Also save when this long has passed since the last save; 0 disables; 'auto'.
    max_save_overhead: float = 0.02  # auto: saves cost at most this fraction of the time (interval >= C / this).
    max_save_interval_secs: float = 3600.0  # auto: the longest interval between two saves.
    max_to_keep: int = 5  # Most recent checkpoints kept (milestones and the newest verified aside).
    keep_every_steps: int = 0  # Steps that are multiples of this are kept forever; 0 disables.
    async_save: bool = True  # Write checkpoints in the background; the step blocks only for the copy.
    resume_from: str = "latest"  # 'latest', 'latest_verified', 'none' (fresh; refuses a non-empty workdir) or a step.
    preemption_grace_secs: float = 60.0  # After a preemption decision the save must commit within this, else exit 1.
    watchdog_secs: float = 600.0  # Longest a step, restore or save may block before the process exits 1.
    lease_secs: float = 60.0  # The workdir lease expires this long after its last renewal (renewed every quarter).

    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes by name, every axis of MESH_AXES present (a missing axis is 1)."""
        sizes = dict.fromkeys(MESH_AXES, 1)
        sizes.update(dict(self.mesh))
        return sizes

    def fixed_fields(self) -> dict:
        return {name: getattr(self, name) for name in FIXED_FIELDS}

    def fixed_hash(self) -> str:
        """A stable hash of the fields a resume must not change."""
        blob = json.dumps(self.fixed_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        fields["mesh"] = dict(self.mesh)
        return fields

    @classmethod
    def from_json(cls, fields: dict) -> "TrainConfig":
        """The inverse of to_json (e.g. the config a manifest recorded); unknown fields are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**{**fields, "mesh": tuple(dict(fields.get("mesh", {})).items())})


# Fields that shape the state or the computed numbers; the mesh, step count, cadences and
# checkpoint policy may change between a run and its resume.
FIXED_FIELDS = (
    "model", "batch_size", "learning_rate", "seed", "input_dim", "hidden_dim", "num_layers",
    "num_heads", "seq_len", "vocab_size",
)


AUTO = "auto"


def parse_save_every_secs(value) -> float | str:
    """'auto', or a number of seconds >= 0 (finite); anything else is a ConfigError naming it."""
    if isinstance(value, str) and value.strip() == AUTO:
        return AUTO
    try:
        secs = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--save_every_secs must be a number of seconds or 'auto', got {value!r}") from None
    if not 0 <= secs < float("inf"):
        raise ConfigError(f"--save_every_secs must be >= 0 seconds or 'auto', got {value!r}")
    return secs


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """Parses 'data=4,model=2' into (('data', 4), ('model', 2)); '' means 'all devices on data'."""
    axes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        name = name.strip()
        if name not in MESH_AXES:
            raise ConfigError(f"--mesh: unknown axis {name!r} in {text!r}; known axes: {', '.join(MESH_AXES)}")
        if not sep or not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh: axis {name!r} needs a positive integer size, got {item!r}")
        if name in dict(axes):
            raise ConfigError(f"--mesh: axis {name!r} given twice in {text!r}")
        axes.append((name, int(size)))
    return tuple(axes)


def validate(config: TrainConfig, device_count: int, *, check_workdir: bool = True) -> TrainConfig:
    """Checks the config against itself and the visible devices; returns it with the mesh filled in.

    A reader of someone else's workdir (the verifier) passes check_workdir=False: it must not probe it.
    """
    if config.model not in MODELS:
        raise ConfigError(f"--model: unknown model {config.model!r}; choose one of {', '.join(MODELS)}")
    for name in ("steps", "batch_size", "log_every_steps", "input_dim", "hidden_dim", "num_layers",
                 "num_heads", "seq_len", "vocab_size", "max_to_keep"):
        if getattr(config, name) < 1:
            raise ConfigError(f"--{name} must be positive, got {getattr(config, name)}")
    for name in ("preemption_grace_secs", "watchdog_secs", "lease_secs"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(config, name)}")
    if config.save_every_secs != AUTO:
        config = dataclasses.replace(config, save_every_secs=parse_save_every_secs(config.save_every_secs))
    if not 0 < config.max_save_overhead <= 1:
        raise ConfigError(f"--max_save_overhead must be in (0, 1], got {config.max_save_overhead}")
    if not config.max_save_interval_secs > 0:
        raise ConfigError(f"--max_save_interval_secs must be positive, got {config.max_save_interval_secs}")
    for name in ("save_every_steps", "keep_every_steps"):
        if getattr(config, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(config, name)}")
    if not config.learning_rate > 0:
        raise ConfigError(f"--learning_rate must be positive, got {config.learning_rate}")
    if config.model == "transformer" and config.hidden_dim % config.num_heads:
        raise ConfigError(f"--num_heads={config.num_heads} does not divide --hidden_dim={config.hidden_dim}")
    if config.resume_from not in ("latest", "latest_verified", "none") and not (
        config.resume_from.isdigit()
    ):
        raise ConfigError(
            f"--resume_from must be latest, latest_verified, none or a step number, got {config.resume_from!r}"
        )
    if not config.mesh:
        config = dataclasses.replace(config, mesh=(("data", device_count),))
    check_mesh(config.mesh, device_count)
    sizes = config.mesh_shape()
    if config.batch_size % sizes["data"]:
        raise ConfigError(
            f"--batch_size={config.batch_size} is not divisible by the data axis ({sizes['data']})"
        )
    if check_workdir:
        validate_workdir(config.workdir)
    return config


def check_mesh(mesh: tuple[tuple[str, int], ...], device_count: int) -> None:
    total = 1
    for _, size in mesh:
        total *= size
    if mesh and total != device_count:
        raise ConfigError(f"--mesh={format_mesh(mesh)} has {total} devices but {device_count} are visible")


def format_mesh(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh)


def validate_workdir(workdir: str) -> None:
    """A local workdir must be a writable directory, or missing with a writable directory as its
    nearest existing parent; gs:// is checked on use. Nothing is created: the trainer makes the
    directory only once it holds the workdir (a refused run leaves nothing behind).
    """
    if not workdir:
        raise ConfigError("--workdir is required")
    if workdir.startswith("gs://"):
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
