"""A Cloud TPU pod run as one bash script of gcloud commands: the TPU, the trainer on every worker
with a restart loop, and the verifier on its own small VM.

  python -m launch.tpu.recipe --project=P --zone=us-east5-a --tpu_name=ckpt \\
      --accelerator_type=v5litepod-16 --runtime_version=v2-alpha-tpuv5-lite \\
      --workdir=gs://BUCKET/run1 --image=us-docker.pkg.dev/P/repo/ckpt:tpu --queued_resource --spot \\
      -- --mesh=data=16 --steps=10000 --save_every_steps=500 > run.sh && bash run.sh

--dry_run (the default) prints the script; --nodry_run runs that same text with bash, so what the
tests read is what runs. The script:
  1. creates the verifier VM if missing (`gcloud compute instances create`), installs the image or
     package there and starts `trainer.verify --follow` on it in the background;
  2. makes sure the TPU is up: created when missing (a queued resource or a TPU VM), deleted and
     created again when preempted (Spot and preemptible TPUs cannot be restarted);
  3. installs the image or package on every worker (`tpu-vm ssh --worker=all`);
  4. runs the trainer on every worker (`--worker=all`), one process per host; each worker exports
     TPU_WORKER_ID and TPU_WORKER_HOSTNAMES from the metadata server first, because
     runtime/distributed.py starts jax.distributed (with no arguments) only when that variable
     lists several hosts, and a TPU VM does not set it;
  5. on exit 75 (preempted, its checkpoint committed), or any exit once the TPU itself is gone,
     goes back to 2: the trainer resumes from the latest committed checkpoint. At most
     --max_restarts times. Exit 2 (bad input) or 1 (failure) with the TPU still up stops the run:
     a blind restart would fail the same way. `--worker=all` exits with the first non-zero worker
     code in worker order; a preemption makes every worker exit 75 together.
  6. after the trainer's exit 0, waits for the verifier to verify the final checkpoint and exits
     with its code (0: every committed step passed, 1: a verdict failed).
"""

import dataclasses
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

_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"
_VENV = "~/ckpt-venv"  # where --install goes on each host (expanded by the host's shell)
_VERIFIER_PIDFILE = "/tmp/ckpt-verifier.pid"


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


# --- commands run on the hosts (each one string, quoted once more for the local script) ------------

def _registry_login(image: str, login: str) -> list[str]:
    """The docker credential set-up for Artifact Registry / Container Registry images; none elsewhere."""
    host = image.split("/", 1)[0]
    if "/" in image and (host.endswith("docker.pkg.dev") or host == "gcr.io" or host.endswith(".gcr.io")):
        return [login.format(host=shlex.quote(host))]
    return []


def _venv_install(requirements: list[str]) -> str:
    make_venv = (f"[ -x {_VENV}/bin/pip ] || {{ sudo apt-get -qq update && sudo apt-get -qq install -y "
                 f"python3-venv && python3 -m venv {_VENV}; }}")
    return " && ".join([make_venv, f"{_VENV}/bin/pip install -q --upgrade pip",
                        f"{_VENV}/bin/pip install -q {' '.join(shlex.quote(r) for r in requirements)}"])


def worker_install_command(recipe: TpuRecipe) -> str:
    if recipe.image:
        login = _registry_login(recipe.image, "sudo gcloud auth configure-docker {host} --quiet")
        return " && ".join(login + [f"sudo docker pull {shlex.quote(recipe.image)}"])
    return _venv_install([recipe.install, "jax[tpu]"])


def trainer_command(recipe: TpuRecipe) -> str:
    curl = "curl -sf -H Metadata-Flavor:Google"
    # JAX reads TPU_WORKER_ID whenever TPU_WORKER_HOSTNAMES is set; the endpoints are either
    # hostnames or name:id:ip triples, and the sed keeps the last field of each.
    pod_env = (f"set -o pipefail && TPU_WORKER_ID=$({curl} {_METADATA}/agent-worker-number) && "
               f"TPU_WORKER_HOSTNAMES=$({curl} {_METADATA}/worker-network-endpoints | sed \"s/[^,]*://g\") && "
               # The workdir lease's job id: a restart of this TPU job waits for the old lease to
               # expire instead of being refused (checkpointing/lease.py).
               f"JOB_ID={shlex.quote(recipe.tpu_name)} && export TPU_WORKER_ID TPU_WORKER_HOSTNAMES JOB_ID")
    flags_ = " ".join(shlex.quote(arg) for arg in (f"--workdir={recipe.workdir}", *recipe.trainer_args))
    if recipe.image:
        # Named, so a container left from an attempt whose ssh session was lost is removed first.
        # sudo drops the environment, so the two variables are passed by value.
        return (f"{pod_env} && {{ sudo docker rm -f ckpt-trainer >/dev/null 2>&1; exec sudo docker run --rm "
                "--name=ckpt-trainer --privileged --net=host -e TPU_WORKER_ID=$TPU_WORKER_ID "
                f"-e TPU_WORKER_HOSTNAMES=$TPU_WORKER_HOSTNAMES -e JOB_ID=$JOB_ID {shlex.quote(recipe.image)} "
                f"train {flags_}; }}")
    return f"{pod_env} && exec {_VENV}/bin/python -m trainer.train {flags_}"


def verifier_install_command(recipe: TpuRecipe) -> str:
    if recipe.image:
        login = _registry_login(recipe.image, "docker-credential-gcr configure-docker --registries={host}")
        return " && ".join(login + [f"docker pull {shlex.quote(recipe.image)}"])
    return _venv_install([recipe.install])


def verifier_command(recipe: TpuRecipe) -> str:
    devices = recipe.verifier_devices
    flags_ = " ".join(shlex.quote(arg) for arg in (
        f"--workdir={recipe.workdir}", f"--mesh={recipe.verifier_mesh}", "--follow"))
    env = f"JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count={devices}"
    if recipe.image:
        return ("docker rm -f ckpt-verifier >/dev/null 2>&1; exec docker run --rm --name=ckpt-verifier "
                f"-e {env.replace(' ', ' -e ')} {shlex.quote(recipe.image)} verify {flags_}")
    # The pid file lets the script stop exactly this process with SIGTERM (exec keeps the shell's pid).
    return f"echo $$ > {_VERIFIER_PIDFILE} && {env} exec {_VENV}/bin/python -m trainer.verify {flags_}"


def verifier_stop_command(recipe: TpuRecipe) -> str:
    # SIGTERM ends --follow cleanly: verdicts already written stay, nothing half-written.
    if recipe.image:
        return "docker stop ckpt-verifier"
    return f"kill -TERM $(cat {_VERIFIER_PIDFILE})"


# --- the local script -----------------------------------------------------------------------------

def _gcloud(*words: str, recipe: TpuRecipe) -> str:
    return shlex.join(["gcloud", *words, f"--project={recipe.project}", f"--zone={recipe.zone}"])


def commands(recipe: TpuRecipe) -> dict[str, str]:
    """Every gcloud command of the script by role, plus the TPU state words the loop tests for."""
    name, vm = recipe.tpu_name, recipe.verifier_vm
    if recipe.queued_resource:
        kind = ["compute", "tpus", "queued-resources"]
        create = [*kind, "create", name, f"--node-id={name}", f"--accelerator-type={recipe.accelerator_type}",
                  f"--runtime-version={recipe.runtime_version}"]
        state = [*kind, "list", f"--filter=name~/queuedResources/{name}$", "--format=value(state.state)"]
        delete = [*kind, "delete", name, "--force", "--quiet"]  # --force: its TPU node too
        states = {"up": "ACTIVE", "dead": "SUSPENDED", "failed": "FAILED"}
    else:
        kind = ["compute", "tpus", "tpu-vm"]
        create = [*kind, "create", name, f"--accelerator-type={recipe.accelerator_type}",
                  f"--version={recipe.runtime_version}"]
        state = [*kind, "list", f"--filter=name~/nodes/{name}$", "--format=value(state)"]
        delete = [*kind, "delete", name, "--quiet"]
        states = {"up": "READY", "dead": "PREEMPTED|TERMINATED", "failed": "FAILED"}
    if recipe.spot:
        create.append("--spot")
    if recipe.preemptible:
        create.append("--preemptible")
    ssh_workers = ["compute", "tpus", "tpu-vm", "ssh", name, "--worker=all", "--quiet"]
    ssh_vm = ["compute", "ssh", vm, "--quiet"]
    # Container-Optimized OS comes with docker; Debian 12 with Python 3.11 (the package needs >= 3.10).
    vm_image = (["--image-family=cos-stable", "--image-project=cos-cloud"] if recipe.image else
                ["--image-family=debian-12", "--image-project=debian-cloud"])
    roles = {
        "tpu_state": state,
        "create_tpu": create,
        "delete_tpu": delete,
        "install_workers": [*ssh_workers, f"--command={worker_install_command(recipe)}"],
        "run_trainer": [*ssh_workers, f"--command={trainer_command(recipe)}"],
        "vm_state": ["compute", "instances", "describe", vm, "--format=value(status)"],
        # cloud-platform: the default scopes only read Cloud Storage, and the verifier writes verdicts.
        "create_vm": ["compute", "instances", "create", vm, f"--machine-type={recipe.verifier_machine_type}",
                      *vm_image, "--scopes=cloud-platform"],
        "install_vm": [*ssh_vm, f"--command={verifier_install_command(recipe)}"],
        "run_verifier": [*ssh_vm, f"--command={verifier_command(recipe)}"],
        "stop_verifier": [*ssh_vm, f"--command={verifier_stop_command(recipe)}"],
        "delete_vm": ["compute", "instances", "delete", vm, "--quiet"],
    }
    return {role: _gcloud(*words, recipe=recipe) for role, words in roles.items()} | states


def script(recipe: TpuRecipe, argv: list[str] | None = None) -> str:
    """The whole run as a bash script (what --dry_run prints and --nodry_run executes)."""
    c = commands(recipe)
    name, vm = recipe.tpu_name, recipe.verifier_vm
    kind = ("queued resource" if recipe.queued_resource else "TPU VM") + (
        ", spot" if recipe.spot else ", preemptible" if recipe.preemptible else "")
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by: python -m launch.tpu.recipe {shlex.join(argv or [])}".rstrip(),
        f"# TPU {name}: {recipe.accelerator_type} ({kind}), runtime {recipe.runtime_version}, "
        f"project {recipe.project}, zone {recipe.zone}.",
        f"# Workdir {recipe.workdir}; verifier VM {vm} ({recipe.verifier_machine_type}, "
        f"--mesh={recipe.verifier_mesh}).",
        "# Trainer exit codes (runtime/exit_codes.py): 0 done, 75 preempted with its checkpoint committed,",
        "# 2 bad input, 1 failure. --worker=all exits with the first non-zero worker code in worker order.",
        "set -u -o pipefail",
        "verifier_pid=",
        "",
        "retry() {  # a fresh VM's sshd and keys take a while to come up",
        "  local try",
        "  for try in 1 2 3 4 5; do",
        '    "$@" && return 0',
        '    echo "attempt $try of 5 failed: $1; retrying in 20s" >&2',
        "    sleep 20",
        "  done",
        "  return 1",
        "}",
        "",
        f"tpu_state() {{  # {c['up']} when usable, MISSING when absent, UNKNOWN when the API call failed",
        "  local state",
        f"  state=$({c['tpu_state']}) || {{ echo UNKNOWN; return; }}",
        '  if [ -n "$state" ]; then echo "$state"; else echo MISSING; fi',
        "}",
        "",
        "create_tpu() {",
        f"  {c['create_tpu']}",
        "}",
        "",
        "delete_tpu() {",
        f"  {c['delete_tpu']}",
        "}",
        "",
        "ensure_tpu() {  # returns once the TPU is up; a preempted one cannot be restarted, only replaced",
        "  local state unknown=0",
        "  while :; do",
        "    state=$(tpu_state)",
        '    case "$state" in',
        f"      {c['up']}) return 0 ;;",
        f'      MISSING) echo "creating TPU {name}" >&2; create_tpu || return 1 ;;',
        f'      {c["dead"]}) echo "TPU {name} is $state: deleting it to create it again" >&2; '
        "delete_tpu || return 1 ;;",
        f'      {c["failed"]}) echo "TPU {name} is $state" >&2; return 1 ;;',
        "      UNKNOWN) unknown=$((unknown + 1))",
        f'        if [ "$unknown" -ge 10 ]; then echo "cannot read the state of TPU {name}" >&2; return 1; fi',
        "        sleep 30 ;;",
        "      *) sleep 30 ;;  # creating, provisioning, waiting for capacity, deleting",
        "    esac",
        "  done",
        "}",
        "",
        "install_workers() {",
        f"  {c['install_workers']}",
        "}",
        "",
        "run_trainer() {  # one process per worker, all workers at once",
        f"  {c['run_trainer']}",
        "}",
        "",
        "start_verifier() {",
        f"  {c['vm_state']} >/dev/null 2>&1 || {c['create_vm']} || return 1",
        f"  retry {c['install_vm']} || return 1",
        f"  {c['run_verifier']} </dev/null &",
        "  verifier_pid=$!",
        "}",
        "",
        "stop() {  # stop CODE MESSAGE: no final checkpoint will come, so the verifier is stopped too",
        '  echo "$2" >&2',
        '  if [ -n "$verifier_pid" ]; then',
        f"    {c['stop_verifier']}",
        '    wait "$verifier_pid"',
        "  fi",
        '  exit "$1"',
        "}",
        "",
        f'start_verifier || stop {exit_codes.FAILURE} "could not start the verifier on {vm}"',
        "restarts=0",
        "while :; do",
        f'  ensure_tpu || stop {exit_codes.FAILURE} "could not create TPU {name}"',
        f"  if retry install_workers; then run_trainer; code=$?; else code={exit_codes.FAILURE}; fi",
        '  [ "$code" -eq 0 ] && break',
        f'  if [ "$code" -ne {exit_codes.PREEMPTED} ] && [ "$(tpu_state)" = {c["up"]} ]; then',
        '    stop "$code" "trainer exited $code with the TPU up: not restarting (2: bad input, 1: failure)"',
        "  fi",
        "  restarts=$((restarts + 1))",
        f'  if [ "$restarts" -gt {recipe.max_restarts} ]; then',
        f'    stop {exit_codes.PREEMPTED} "preempted again after {recipe.max_restarts} restarts: giving up; rerun this script to go on"',
        "  fi",
        f'  echo "trainer exited $code (preempted): restart $restarts of {recipe.max_restarts}, from the latest '
        'committed checkpoint" >&2',
        "done",
        f'echo "trainer done; waiting for the verifier on {vm} to verify the final checkpoint" >&2',
        'wait "$verifier_pid"',
        "code=$?",
        'echo "verifier exited $code (0: every committed checkpoint passed, 1: a verdict failed)" >&2',
        'exit "$code"',
        "",
        "# Afterwards, to stop paying for them:",
        f"#   {c['delete_tpu']}",
        f"#   {c['delete_vm']}",
    ]
    return "\n".join(lines) + "\n"


def execute(text: str) -> int:
    """Runs the script with bash (-c, not stdin: gcloud ssh reads stdin) and returns its exit code."""
    if shutil.which("gcloud") is None:
        raise common.RecipeError("gcloud is not on PATH; use --dry_run to print the commands instead")
    logging.info("running the %d-line script", text.count("\n"))
    return subprocess.run(["bash", "-c", text, "tpu-recipe"]).returncode


def main(argv: list[str]) -> None:
    try:
        recipe = recipe_from_flags(argv[1:])
        text = script(recipe, sys.argv[1:])
        if DRY_RUN.value:
            sys.stdout.write(text)
            return
        code = execute(text)
    except ValueError as err:  # RecipeError and ConfigError (the verifier mesh)
        exit_codes.exit_bad_input(err)
    sys.exit(code)


if __name__ == "__main__":
    entry.run(main, takes_arguments=True)
