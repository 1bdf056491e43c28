"""Entry point: measures how far a model drifts across layouts and writes the tolerances its spec
should carry (verifier/drift.py does the measuring; docs/verifier.md explains the numbers).

  python -m verifier.calibrate --model=transformer --compute_dtype=bfloat16 \\
      --meshes='data=4,model=2;data=8;data=2,model=4' --windows=1,2,4,8,16 --steps=20 --out=tolerances.json

Trains --steps steps on the first mesh (the recording layout), then replays windows of k steps from
there (and from the init) on every other mesh, and runs seed 003's broken resumes on the first. Prints
one line per window (to stdout: the result) and writes --out: the tolerances for an interval from a
saved step, and those for one from the init (a full proof's first), which a spec's init_tolerances
or the verifier's --tolerances=FILE reads. Every model flag of the trainer applies (--hidden_dim,
the optimizer's, a spec's own fields); --workdir is not used. On a CPU-only machine it fakes 8 devices
unless XLA_FLAGS already says how many.
"""

import json
import math
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from absl import flags, logging  # noqa: E402

from checkpointing.config import ConfigError  # noqa: E402
from runtime import entry  # noqa: E402
from runtime import mesh as mesh_lib  # noqa: E402
from trainer import flags as trainer_flags  # noqa: E402  (the model's flags, a spec's own fields included)
from trainer import model_config  # noqa: E402
from trainer.program import validate  # noqa: E402
from verifier import drift, tolerances  # noqa: E402

MESHES = flags.DEFINE_string("meshes", "data=4,model=2;data=8;data=2,model=4",
                             "';'-separated meshes: the first records, each other one replays (each over the "
                             "first devices it needs).")
WINDOWS = flags.DEFINE_string("windows", "1,2,4,8,16", "','-separated replay lengths in steps.")
OUT = flags.DEFINE_string("out", "tolerances.json", "Where the derived tolerances are written (JSON).")
SAFETY = flags.DEFINE_float("safety", 10.0, "A tolerance is the largest measured drift times this.",
                            lower_bound=1.0)
SIGNAL_MARGIN = flags.DEFINE_float("signal_margin", 10.0, "A tolerance may be at most the smallest broken-resume "
                                   "signal over this; else the model cannot be proved across layouts.",
                                   lower_bound=1.0)
NOISE_RATIO = flags.DEFINE_float("noise_ratio", tolerances.NOISE_RATIO,
                                 "Leaves whose Adam first moment's RMS is at most this fraction of the largest "
                                 "are noise-driven (bfloat16 compute needs a larger one than float32).",
                                 lower_bound=0.0)


def parse_meshes(text: str) -> list[tuple[tuple[str, int], ...]]:
    meshes = [mesh_lib.parse(part) for part in text.split(";") if part.strip()]
    if len(meshes) < 2 or any(not mesh for mesh in meshes):
        raise ConfigError(f"--meshes={text!r}: give two or more meshes separated by ';', e.g. data=4,model=2;data=8")
    return meshes


def parse_windows(text: str) -> list[int]:
    try:
        windows = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--windows={text!r}: give step counts separated by ',', e.g. 1,2,4") from None
    if not windows or windows[0] < 1:
        raise ConfigError(f"--windows={text!r}: every window must be at least 1 step")
    return windows


def main(argv: list[str]) -> None:
    if flags.FLAGS["mesh"].present:
        raise ConfigError("--mesh: give the layouts with --meshes (the first one records)")
    meshes, windows = parse_meshes(MESHES.value), parse_windows(WINDOWS.value)
    if not flags.FLAGS.workdir:
        flags.FLAGS.workdir = "unused"  # the trainer's config wants one; nothing is written there
    sizes = [math.prod(size for _, size in mesh) for mesh in meshes]
    if max(sizes) > jax.device_count():
        mesh_lib.check(meshes[sizes.index(max(sizes))], jax.device_count())  # its error says how to fake devices
    config = trainer_flags.config_from_flags()
    if config.steps < 1:  # at the init the moments are zero and step 0 is the right index: nothing is broken
        raise ConfigError("--steps must be at least 1: seed 003's broken resumes need a trained state")
    # The run covers the windows (a schedule whose length defaults to --steps must not end before them).
    config = validate(model_config.replace(config, mesh=meshes[0], steps=config.steps + windows[-1]), sizes[0],
                      check_workdir=False)
    for mesh, size in zip(meshes[1:], sizes[1:]):  # a mesh may use fewer devices than the machine has
        validate(model_config.replace(config, mesh=mesh), size, check_workdir=False)
    logging.info("calibrating %s: %d steps on %s, windows %s on %s", config.model, config.steps - windows[-1],
                 drift.mesh_label(meshes[0]), windows, "; ".join(drift.mesh_label(m) for m in meshes[1:]))
    found = drift.measure(config, meshes, windows, config.steps - windows[-1], NOISE_RATIO.value)
    rows = drift.per_window(found)
    derived = drift.derive(rows, SAFETY.value, SIGNAL_MARGIN.value, NOISE_RATIO.value)
    result = {"model": config.model, "model_fields": dict(config.model_fields),
              "fixed_fields": model_config.fixed_fields(config),
              "meshes": [drift.mesh_label(m) for m in meshes], "windows": windows,
              "start_step": config.steps - windows[-1], **derived, "per_window": rows,
              "per_mesh": [d.as_dict() for d in found]}
    with open(OUT.value, "w") as f:
        json.dump(result, f, indent=1)
    print(drift.table(rows, derived))
    logging.info("wrote %s", OUT.value)


if __name__ == "__main__":
    entry.run(main)
