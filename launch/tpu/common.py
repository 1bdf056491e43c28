"""Checks shared by the cloud recipes (Cloud TPU VMs in this package, GKE in launch/gke).

Every check raises RecipeError (a ValueError) naming the flag and its value; runtime/entry.py's
run() turns it into one line on stderr and exit 2 before the recipe prints anything, so a bad
command never reaches a half-created TPU.
"""

import math
import re

from trainer.config import TrainConfig, parse_mesh

# Bucket names are 3-222 lowercase letters, digits, '-', '_' and '.'; no spaces in the path.
_BUCKET = re.compile(r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]")
# Compute Engine / Cloud TPU resource names (RFC 1035 labels, at most 63 characters).
_RESOURCE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# Container image references: registry/path[:tag][@digest]; no shell or template characters.
_IMAGE = re.compile(r"[a-z0-9][-a-z0-9._/]*(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@sha256:[0-9a-f]{64})?")

# Trainer flags the recipes set themselves: the same flag twice would silently take the last value.
_RECIPE_OWNED_TRAINER_FLAGS = {
    "workdir": "give it to the recipe as --workdir",
    "coordinator_address": "a TPU pod starts jax.distributed from the TPU environment",
    "num_processes": "a TPU pod starts jax.distributed from the TPU environment",
    "process_id": "a TPU pod starts jax.distributed from the TPU environment",
}


class RecipeError(ValueError):
    """A recipe flag is unusable; the message names the flag and its value."""


def check_workdir(workdir: str | None) -> str:
    # Every host and the verifier must see one directory; a local path on a TPU host is private to it.
    if not workdir:
        raise RecipeError("--workdir is required: a gs://BUCKET/PATH every host and the verifier can reach")
    if not workdir.startswith("gs://"):
        raise RecipeError(f"--workdir={workdir!r} must be a gs://BUCKET/PATH (every host and the verifier "
                          "must see the same directory)")
    bucket, _, path = workdir[len("gs://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise RecipeError(f"--workdir={workdir!r}: {bucket!r} is not a bucket name (3-222 lowercase letters, "
                          "digits, '-', '_' or '.')")
    if any(c.isspace() for c in path):
        raise RecipeError(f"--workdir={workdir!r} must not contain whitespace")
    return workdir


def check_resource_name(flag: str, value: str | None) -> str:
    if not value:
        raise RecipeError(f"--{flag} is required")
    if not _RESOURCE_NAME.fullmatch(value):
        raise RecipeError(f"--{flag}={value!r} must be 1-63 lowercase letters, digits or '-', starting with a "
                          "letter and not ending with '-'")
    return value


def check_image(flag: str, value: str) -> str:
    if not _IMAGE.fullmatch(value):
        raise RecipeError(f"--{flag}={value!r} is not a container image reference (REGISTRY/PATH[:TAG])")
    return value


def check_trainer_args(args: list[str]) -> tuple[str, ...]:
    """The trainer flags given after `--`: each --name=value (or a boolean --name/--noname)."""
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            raise RecipeError(f"trainer flags after -- must each be --name=value, got {arg!r}")
        name = arg[2:].partition("=")[0]
        if name in _RECIPE_OWNED_TRAINER_FLAGS:
            raise RecipeError(f"do not pass --{name} to the trainer: {_RECIPE_OWNED_TRAINER_FLAGS[name]}")
    return tuple(args)


def preemption_grace_secs(trainer_args: tuple[str, ...]) -> float:
    """The trainer's --preemption_grace_secs as it will parse it: the last one given, else the default."""
    value = TrainConfig().checkpoint.preemption_grace_secs
    for arg in trainer_args:
        name, _, text = arg[2:].partition("=")
        if name == "preemption_grace_secs":
            try:
                value = float(text)
            except ValueError:
                raise RecipeError(f"--preemption_grace_secs={text!r} is not a number") from None
    if not value > 0:
        raise RecipeError(f"--preemption_grace_secs must be positive, got {value}")
    return value


def verifier_devices(mesh_text: str) -> int:
    """Fake CPU devices the verifier needs for its --mesh (it runs on a CPU machine)."""
    try:
        mesh = parse_mesh(mesh_text)
    except ValueError as err:  # its message names --mesh, the verifier's own flag
        raise RecipeError(f"--verifier_mesh={mesh_text!r}: {err}") from None
    if not mesh:
        raise RecipeError("--verifier_mesh is required, e.g. data=4")
    return math.prod(size for _, size in mesh)
