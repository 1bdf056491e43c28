"""A Cloud TPU pod run: launch/tpu/run.sh, checked in, driven by variables this recipe validates.

  python -m launch.tpu.recipe --project=P --zone=us-east5-a --tpu_name=ckpt \\
      --accelerator_type=v5litepod-16 --runtime_version=v2-alpha-tpuv5-lite \\
      --workdir=gs://BUCKET/run1 --image=us-docker.pkg.dev/P/repo/ckpt:tpu --queued_resource --spot \\
      -- --mesh=data=16 --steps=10000 --save_every_steps=500 > run.sh && bash run.sh

--dry_run (the default) prints the variables followed by run.sh; --nodry_run runs that same text
with bash, so what the tests read is what runs. run.sh says what the run does: the TPU, the
trainer on every worker with a restart loop on preemption, and the verifier on its own small VM.
Bad input is a ValueError, one line and exit 2 before anything is printed.
"""

import dataclasses
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from absl import flags, logging

from runtime import entry, exit_codes
from launch.tpu import common

PROJECT = flags.DEFINE_string("project", None, "Google Cloud project.")
ZONE = flags.DEFINE_string("zone", None, "Zone of the TPU and the verifier VM, e.g. us-east5-a.")
TPU_NAME = flags.DEFINE_string("tpu_name", None, "TPU VM name (also the queued resource's name and node id).")
ACCELERATOR_TYPE = flags.DEFINE_string("accelerator_type", None, "TPU type, e.g. v5litepod-16, v5p-32, v4-32.")
RUNTIME_VERSION = flags.DEFINE_string("runtime_version", None, "TPU software version, e.g. v2-alpha-tpuv5-lite.")
WORKDIR = flags.DEFINE_string("workdir", None, "The run's gs://BUCKET/PATH (checkpoints, verdicts, metrics).")
IMAGE = flags.DEFINE_string("image", None, "Container image built with docker/Dockerfile (JAX_EXTRA=tpu).")
INSTALL = flags.DEFINE_string("install", None, "Or a pip requirement of this project (with its gcs extra) "
                              "to install in a virtual environment on every host.")
QUEUED_RESOURCE = flags.DEFINE_boolean("queued_resource", False, "Ask for the TPU as a queued resource.")
SPOT = flags.DEFINE_boolean("spot", False, "Spot TPU: cheaper, preempted at any time.")
PREEMPTIBLE = flags.DEFINE_boolean("preemptible", False, "Preemptible TPU VM (not with --queued_resource).")
VERIFIER_VM = flags.DEFINE_string("verifier_vm", None, "Verifier VM name; default TPU_NAME-verifier.")
VERIFIER_MACHINE_TYPE = flags.DEFINE_string("verifier_machine_type", "e2-standard-8", "Verifier VM machine type.")
VERIFIER_MESH = flags.DEFINE_string("verifier_mesh", "data=4",
                                    "The verifier's --mesh, on as many fake CPU devices as it names.")
MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 20, "Restarts after a preemption before giving up.",
                                    lower_bound=0)
DRY_RUN = flags.DEFINE_boolean("dry_run", True, "Print the script; --nodry_run runs it with bash.")

_ACCELERATOR_TYPE = re.compile(r"v[2-9][a-z]*-[1-9][0-9]*")
_RUNTIME_VERSION = re.compile(r"[a-z0-9][-a-z0-9.]*")
_PROJECT = re.compile(r"[a-z][-a-z0-9]{4,28}[a-z0-9]")
_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
_MACHINE_TYPE = re.compile(r"[a-z][a-z0-9]*-[-a-z0-9]+")

RUN_SH = pathlib.Path(__file__).with_name("run.sh")


@dataclasses.dataclass(frozen=True)
class TpuRecipe:
    project: str
    zone: str
    tpu_name: str
    accelerator_type: str
    runtime_version: str
    workdir: str
    image: str | None  # exactly one of image and install
    install: str | None
    queued_resource: bool
    spot: bool
    preemptible: bool
    verifier_vm: str
    verifier_machine_type: str
    verifier_mesh: str
    max_restarts: int
    trainer_args: tuple[str, ...]

    @property
    def verifier_devices(self) -> int:
        return common.verifier_devices(self.verifier_mesh)


def _check(pattern: re.Pattern, flag: str, value: str | None, example: str) -> str:
    if not value:
        raise common.RecipeError(f"--{flag} is required, e.g. --{flag}={example}")
    if not pattern.fullmatch(value):
        raise common.RecipeError(f"--{flag}={value!r} is not valid, expected something like {example}")
    return value


def recipe_from_flags(trainer_args: list[str]) -> TpuRecipe:
    """The parsed flags as a checked TpuRecipe; RecipeError (a ValueError) names the first bad flag."""
    tpu_name = common.check_resource_name("tpu_name", TPU_NAME.value)
    if bool(IMAGE.value) == bool(INSTALL.value):
        raise common.RecipeError("give exactly one of --image and --install")
    if SPOT.value and PREEMPTIBLE.value:
        raise common.RecipeError("give at most one of --spot and --preemptible")
    if PREEMPTIBLE.value and QUEUED_RESOURCE.value:
        raise common.RecipeError("--preemptible is not available for queued resources; use --spot")
    if INSTALL.value is not None and (not INSTALL.value.strip() or "\n" in INSTALL.value):
        raise common.RecipeError(f"--install={INSTALL.value!r} is not a pip requirement")
    recipe = TpuRecipe(
        project=_check(_PROJECT, "project", PROJECT.value, "my-project"),
        zone=_check(_ZONE, "zone", ZONE.value, "us-east5-a"),
        tpu_name=tpu_name,
        accelerator_type=_check(_ACCELERATOR_TYPE, "accelerator_type", ACCELERATOR_TYPE.value, "v5litepod-16"),
        runtime_version=_check(_RUNTIME_VERSION, "runtime_version", RUNTIME_VERSION.value, "v2-alpha-tpuv5-lite"),
        workdir=common.check_workdir(WORKDIR.value),
        image=common.check_image("image", IMAGE.value) if IMAGE.value else None,
        install=INSTALL.value or None,
        queued_resource=QUEUED_RESOURCE.value,
        spot=SPOT.value,
        preemptible=PREEMPTIBLE.value,
        verifier_vm=common.check_resource_name("verifier_vm", VERIFIER_VM.value or f"{tpu_name}-verifier"),
        verifier_machine_type=_check(_MACHINE_TYPE, "verifier_machine_type", VERIFIER_MACHINE_TYPE.value,
                                     "e2-standard-8"),
        verifier_mesh=VERIFIER_MESH.value,
        max_restarts=MAX_RESTARTS.value,
        trainer_args=common.check_trainer_args(trainer_args),
    )
    common.verifier_devices(recipe.verifier_mesh)  # a bad --verifier_mesh is bad input before any output
    common.preemption_grace_secs(recipe.trainer_args)
    return recipe


def variables(recipe: TpuRecipe) -> dict[str, str]:
    """The inputs of run.sh (described at its top), each a validated value."""
    as_word = {True: "true", False: "false"}
    return {
        "PROJECT": recipe.project, "ZONE": recipe.zone, "TPU_NAME": recipe.tpu_name,
        "ACCELERATOR_TYPE": recipe.accelerator_type, "RUNTIME_VERSION": recipe.runtime_version,
        "QUEUED_RESOURCE": as_word[recipe.queued_resource], "SPOT": as_word[recipe.spot],
        "PREEMPTIBLE": as_word[recipe.preemptible], "WORKDIR": recipe.workdir,
        "IMAGE": recipe.image or "", "INSTALL": recipe.install or "",
        # Shell words, as the host's shell will read them after --workdir.
        "TRAINER_FLAGS": shlex.join(recipe.trainer_args),
        "VERIFIER_VM": recipe.verifier_vm, "VERIFIER_MACHINE_TYPE": recipe.verifier_machine_type,
        "VERIFIER_MESH": recipe.verifier_mesh, "VERIFIER_DEVICES": str(recipe.verifier_devices),
        "MAX_RESTARTS": str(recipe.max_restarts),
        "EXIT_OK": str(exit_codes.OK), "EXIT_FAILURE": str(exit_codes.FAILURE),
        "EXIT_BAD_INPUT": str(exit_codes.BAD_INPUT), "EXIT_PREEMPTED": str(exit_codes.PREEMPTED),
    }


def script(recipe: TpuRecipe, argv: list[str] | None = None) -> str:
    """The whole run as a bash script (what --dry_run prints and --nodry_run executes): the
    variables, then run.sh as checked in (less its #! line)."""
    kind = ("queued resource" if recipe.queued_resource else "TPU VM") + (
        ", spot" if recipe.spot else ", preemptible" if recipe.preemptible else "")
    header = [
        "#!/usr/bin/env bash",
        f"# Generated by: python -m launch.tpu.recipe {shlex.join(argv or [])}".rstrip(),
        f"# TPU {recipe.tpu_name}: {recipe.accelerator_type} ({kind}), runtime {recipe.runtime_version}, "
        f"project {recipe.project}, zone {recipe.zone}.",
        f"# Workdir {recipe.workdir}; verifier VM {recipe.verifier_vm} ({recipe.verifier_machine_type}, "
        f"--mesh={recipe.verifier_mesh}).",
        *(f"{name}={shlex.quote(value)}" for name, value in variables(recipe).items()),
        "",
    ]
    body = RUN_SH.read_text()
    if body.startswith("#!"):
        body = body.partition("\n")[2]
    return "\n".join(header) + "\n" + body


def execute(text: str) -> int:
    """Runs the script with bash (-c, not stdin: gcloud ssh reads stdin) and returns its exit code."""
    if shutil.which("gcloud") is None:
        raise common.RecipeError("gcloud is not on PATH; use --dry_run to print the commands instead")
    logging.info("running the %d-line script", text.count("\n"))
    return subprocess.run(["bash", "-c", text, "tpu-recipe"]).returncode


def main(argv: list[str]) -> int:
    """Bad input raises ValueError (RecipeError, or ConfigError for the verifier mesh): entry.run
    turns it into exit 2 and one line, before anything is printed or run."""
    text = script(recipe_from_flags(argv[1:]), sys.argv[1:])
    if DRY_RUN.value:
        sys.stdout.write(text)
        return exit_codes.OK
    return execute(text)


if __name__ == "__main__":
    entry.run(main, takes_arguments=True)
