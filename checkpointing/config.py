"""What checkpointing needs to know about a run: cadence, retention, resume and deadlines.

Owned here and composed into the trainer's config (`TrainConfig.checkpoint`), as levanter's
CheckpointerConfig is. Each field carries its help text and bounds as metadata (`option`): the
trainer's flags are generated from it and `check_fields` validates it, so each lives once.
"""

import dataclasses
import math
import os
from collections.abc import Mapping

from checkpointing._src import object_store
from checkpointing._src.object_store import is_object_store  # noqa: F401  (re-exported: the trainer's checks)
from runtime import mesh as mesh_lib
from runtime.mesh import format_mesh  # noqa: F401  (re-exported: checkpointing.format_mesh)

AUTO = "auto"  # --save_every_secs=auto: the interval that maximises goodput (checkpointing/_src/policy.py)
# --save_every_secs's default: `auto` when no step cadence is given (a run always saves), else off.
BY_STEPS_OR_AUTO = "default"
RESUME_NAMES = ("latest", "latest_verified", "none")
PROBE_SUMMARIES = (AUTO, "device")  # --probe_summaries (checkpointing/_src/probes.py)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and the value."""


def option(default, help_text: str, *, minimum: float | None = None, positive: bool = False,
           maximum: float | None = None):
    """A config field with its flag help and its bounds (minimum and maximum inclusive)."""
    return dataclasses.field(default=default, metadata={"help": help_text, "minimum": minimum, "positive": positive,
                                                        "maximum": maximum})


def check_fields(config) -> None:
    """Checks every numeric field of a config dataclass against the bounds in its metadata."""
    for field in dataclasses.fields(config):
        value, meta = getattr(config, field.name), field.metadata
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"--{field.name} must be a finite number, got {value}")
        if meta.get("positive") and not value > 0:
            raise ConfigError(f"--{field.name} must be positive, got {value}")
        if meta.get("minimum") is not None and not value >= meta["minimum"]:
            raise ConfigError(f"--{field.name} must be >= {meta['minimum']}, got {value}")
        if meta.get("maximum") is not None and not value <= meta["maximum"]:
            raise ConfigError(f"--{field.name} must be <= {meta['maximum']}, got {value}")


# Characters a path cannot hold and round-trip through Orbax and TensorStore: Orbax finds each process's
# files of a step by globbing under the step's path (a wildcard there matches other directories, or
# nothing: a bracket made every save of `exp[lr=0.01]` unrestorable), and TensorStore's file driver reads a
# backslash as a separator. Control characters would split the one-line errors that name the path.
_UNSAFE_IN_PATHS = {"*": "a glob wildcard", "?": "a glob wildcard", "[": "a glob bracket", "\\": "a backslash"}


def resolve_path(value: str, flag: str) -> str:
    """A path flag as every process and library must see it: a local path made absolute once, here
    (Orbax refuses relative ones, and a process's working directory is not its peers'), '~' expanded;
    a gs:// or s3:// URL as given. A ConfigError names the flag and the character that cannot round-trip,
    or the URL scheme no workdir can be on."""
    for char in value:
        why = _UNSAFE_IN_PATHS.get(char) or ("a control character" if ord(char) < 32 or ord(char) == 127 else None)
        if why:
            raise ConfigError(f"{flag}={value!r}: {why} ({char!r}) cannot be saved and restored by Orbax; "
                              "choose a path without * ? [ \\ or control characters")
    if "://" in value:
        if not object_store.is_object_store(value) or not object_store.split(value)[0]:
            raise ConfigError(f"{flag}={value!r}: not a local path, gs://BUCKET/PATH or s3://BUCKET/PATH")
        return value
    if not value:
        return value
    return os.path.abspath(os.path.expanduser(value))


def make_mesh(mesh: str | Mapping[str, int] = "", devices=None):
    """The jax Mesh a loop of one's own should train on: axes `data` and `model` ("data=4,model=2", or
    {"data": 4, "model": 2}; a missing axis is 1; "" puts every device on data) over `devices` (default:
    all). Its axes are Auto, so shardings are given at the jit boundaries and flax's Dropout works on a
    batch sharded P("data"): jax.make_mesh's default on jax 0.10, Explicit axes, makes it raise
    ShardingTypeError. The trainer, the verifier and the examples build theirs with it (runtime/mesh.py)."""
    pairs = mesh_lib.parse(mesh, "mesh") if isinstance(mesh, str) else tuple(mesh.items())
    return mesh_lib.build(pairs, devices)


def parse_save_every_secs(value) -> float | str:
    """'auto', or a number of seconds >= 0 (finite); anything else is a ConfigError naming it."""
    if isinstance(value, str) and value.strip() in (AUTO, BY_STEPS_OR_AUTO):
        return value.strip()
    try:
        secs = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--save_every_secs must be a number of seconds or 'auto', got {value!r}") from None
    if not 0 <= secs < float("inf"):
        raise ConfigError(f"--save_every_secs must be >= 0 seconds or 'auto', got {value!r}")
    return secs


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_every_steps: int = option(0, "Save when the step is a multiple of this; 0 disables.", minimum=0)
    save_every_secs: float | str = option(
        BY_STEPS_OR_AUTO, "Also save when this long has passed since the last save; 0 disables; 'auto': a first "
        "save within a minute (--max_save_interval_secs if shorter), then the interval that maximises goodput "
        "(Young/Daly, from measured save costs and interruptions); 'default': auto when --save_every_steps is 0 "
        "(so a run always saves), else 0.")
    max_save_overhead: float = option(0.02, "--save_every_secs=auto: saves cost at most this fraction of the time.",
                                      positive=True, maximum=1)
    max_save_interval_secs: float = option(3600.0, "--save_every_secs=auto: the longest interval between saves.",
                                           positive=True)
    max_to_keep: int = option(5, "Newest committed checkpoints kept (milestones and the newest reproduced step "
                                 "are kept aside).", minimum=1)
    keep_every_steps: int = option(0, "Steps that are multiples of this are kept forever; 0 disables.", minimum=0)
    async_save: bool = option(True, "Write checkpoints in the background; the step blocks only for the copy.")
    resume_from: str = option("latest", "latest | latest_verified | none (fresh; refuses a workdir with "
                                        "checkpoints) | STEP (see checkpointing/_src/restore.py).")
    rollback: bool = option(False, "With --resume_from=STEP: a deliberate rollback; the committed steps newer "
                                   "than STEP and their verdicts are moved to superseded/ (never deleted). With "
                                   "--resume_from=none: every committed step moves there, and the run starts over.")
    preemption_grace_secs: float = option(60.0, "After a preemption decision the save must commit within this "
                                                "many seconds, else exit 1.", positive=True)
    local_dir: str = option("", "Each host's own fast storage (RAM disk, local SSD) for the local tier; '{process}' "
                                "expands to the process index (needed when processes share a machine). Empty: no "
                                "local tier.")
    local_save_every_steps: int = option(0, "Save to --local_dir when the step is a multiple of this; 0: only at "
                                            "a preemption.", minimum=0)
    local_max_to_keep: int = option(2, "Newest local steps each host keeps.", minimum=1)
    init_from: str = option("", "A fresh run starts from another run's committed step, WORKDIR[:STEP] (newest if no "
                                "STEP): its params, with this run's fresh optimizer state. Recorded in every manifest; "
                                "the verifier proves the run from that step's fingerprints, not from the seed.")
    probe_steps: int = option(4, "After each persistent save, record the losses of this many steps and a per-leaf "
                                 "summary of the state after them, for the verifier's cheap proof (the checkpoint "
                                 "resumes the run); 0 records none.", minimum=0)
    probe_summaries: str = option(AUTO, "Where each probe's per-leaf summaries are computed: 'auto', on the host "
                                        "where the state already lies in host memory (CPU devices) and process 0 "
                                        "holds every leaf whole, else on the devices; 'device', always on the "
                                        "devices (inside the step, when the loop passes its marks).")
    lease_secs: float = option(60.0, "The workdir lease expires this long after its holder's last renewal "
                                     "(renewed every quarter): a restart after a kill on another host waits "
                                     "at most this.", positive=True)

    def validated(self) -> "CheckpointConfig":
        """This config checked against itself, with --save_every_secs parsed; a ConfigError names the flag."""
        secs = parse_save_every_secs(self.save_every_secs)
        if secs == BY_STEPS_OR_AUTO:
            secs = 0.0 if self.save_every_steps else AUTO
        config = dataclasses.replace(self, save_every_secs=secs)
        check_fields(config)
        if config.resume_from not in RESUME_NAMES and not config.resume_from.isdigit():
            raise ConfigError(f"--resume_from must be latest, latest_verified, none or a step number, "
                              f"got {config.resume_from!r}")
        if config.probe_summaries not in PROBE_SUMMARIES:
            raise ConfigError(f"--probe_summaries must be {' or '.join(PROBE_SUMMARIES)}, "
                              f"got {config.probe_summaries!r}")
        if config.local_save_every_steps and not config.local_dir:
            raise ConfigError("--local_save_every_steps needs --local_dir")
        if "://" in config.local_dir:
            raise ConfigError(f"--local_dir={config.local_dir} must be a path on this host's own disk")
        return dataclasses.replace(config, local_dir=resolve_path(config.local_dir, "--local_dir"),
                                   init_from=_resolve_init_from(config.init_from))


    @property
    def fixed_save_every_secs(self) -> float:
        """The time cadence when it is fixed; 0 under 'auto' (the trainer's AutoInterval decides)."""
        return 0.0 if self.save_every_secs == AUTO else float(self.save_every_secs)


def _resolve_init_from(value: str) -> str:
    """--init_from=WORKDIR[:STEP] with WORKDIR resolved (resolve_path), the step kept."""
    source, sep, step = value.rpartition(":")
    if not (source and step.isdigit()):
        source, sep, step = value, "", ""
    return resolve_path(source, "--init_from") + sep + step
