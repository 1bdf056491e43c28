"""absl flags for the trainer and verifier, and the one place they become a TrainConfig."""

import dataclasses

from absl import flags

from trainer.config import ConfigError, TrainConfig, parse_mesh, parse_save_every_secs

_DEFAULTS = TrainConfig()

WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, verdicts and metrics (local path or gs://).")
MESH = flags.DEFINE_string("mesh", "", "Axis sizes by name, e.g. data=4,model=2; a missing axis is 1; "
                           "the product must equal the device count. Empty: data=<all devices>.")
COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None,
    "JAX's persistent compilation cache (local disk per host); unset: $XDG_CACHE_HOME (else ~/.cache)"
    "/jax-checkpoint-service/compile; empty: no cache.")
_FIELDS = {
    "model": flags.DEFINE_enum("model", _DEFAULTS.model, ["mlp", "transformer"], "Model to train."),
    "steps": flags.DEFINE_integer("steps", _DEFAULTS.steps, "Total steps of the run.", lower_bound=1),
    "batch_size": flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Global batch size.", lower_bound=1),
    "learning_rate": flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Adam step size."),
    "seed": flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the init and of every batch."),
    "log_every_steps": flags.DEFINE_integer("log_every_steps", _DEFAULTS.log_every_steps,
                                            "Pull losses to the host and log them this often.", lower_bound=1),
    "input_dim": flags.DEFINE_integer("input_dim", _DEFAULTS.input_dim, "mlp: features per example.", lower_bound=1),
    "hidden_dim": flags.DEFINE_integer("hidden_dim", _DEFAULTS.hidden_dim,
                                       "mlp hidden width / transformer model width.", lower_bound=1),
    "num_layers": flags.DEFINE_integer("num_layers", _DEFAULTS.num_layers,
                                       "mlp hidden layers / transformer blocks.", lower_bound=1),
    "num_heads": flags.DEFINE_integer("num_heads", _DEFAULTS.num_heads, "transformer: attention heads.", lower_bound=1),
    "seq_len": flags.DEFINE_integer("seq_len", _DEFAULTS.seq_len, "transformer: tokens per example.", lower_bound=1),
    "vocab_size": flags.DEFINE_integer("vocab_size", _DEFAULTS.vocab_size, "transformer: vocabulary.", lower_bound=2),
    "save_every_steps": flags.DEFINE_integer("save_every_steps", _DEFAULTS.save_every_steps,
                                             "Save when the step is a multiple of this; 0 disables.", lower_bound=0),
    "save_every_secs": flags.DEFINE_string("save_every_secs", str(_DEFAULTS.save_every_secs),
                                           "Also save when this long has passed since the last save; 0 disables; "
                                           "'auto': the interval that maximises goodput (Young/Daly)."),
    "max_save_overhead": flags.DEFINE_float("max_save_overhead", _DEFAULTS.max_save_overhead,
                                            "--save_every_secs=auto: saves cost at most this fraction of the time."),
    "max_save_interval_secs": flags.DEFINE_float("max_save_interval_secs", _DEFAULTS.max_save_interval_secs,
                                                 "--save_every_secs=auto: the longest interval between two saves."),
    "max_to_keep": flags.DEFINE_integer("max_to_keep", _DEFAULTS.max_to_keep,
                                        "Newest committed checkpoints kept.", lower_bound=1),
    "keep_every_steps": flags.DEFINE_integer("keep_every_steps", _DEFAULTS.keep_every_steps,
                                             "Steps that are multiples of this are kept forever; 0 disables.",
                                             lower_bound=0),
    "async_save": flags.DEFINE_boolean("async_save", _DEFAULTS.async_save,
                                       "Write checkpoints in the background (the step blocks only for the copy)."),
    "resume_from": flags.DEFINE_string("resume_from", _DEFAULTS.resume_from,
                                       "latest | latest_verified | none | STEP (see trainer/checkpoints.py)."),
    "preemption_grace_secs": flags.DEFINE_float(
        "preemption_grace_secs", _DEFAULTS.preemption_grace_secs,
        "After SIGTERM the final save must commit within this many seconds, else exit 1."),
    "watchdog_secs": flags.DEFINE_float("watchdog_secs", _DEFAULTS.watchdog_secs,
                                        "Longest a step, restore or save may block before exiting 1."),
    "lease_secs": flags.DEFINE_float("lease_secs", _DEFAULTS.lease_secs,
                                     "The workdir lease expires this long after its holder's last renewal: "
                                     "a restart after a kill on another host waits at most this."),
}


def config_from_flags(**extra) -> TrainConfig:
    """The TrainConfig the parsed flags describe (not yet checked against the devices)."""
    if not WORKDIR.value:
        raise ConfigError("--workdir is required")
    values = {name: flag.value for name, flag in _FIELDS.items()}
    values["save_every_secs"] = parse_save_every_secs(values["save_every_secs"])
    return dataclasses.replace(_DEFAULTS, workdir=WORKDIR.value, mesh=parse_mesh(MESH.value), **values, **extra)
