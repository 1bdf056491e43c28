"""The cloud recipes as a user runs them, read back the way gcloud, bash and kubectl would read them.

`python -m launch.tpu.recipe` prints a bash script of gcloud commands; its restart loop also runs
here for real with --nodry_run against a fake `gcloud` on PATH that plays the TPU's states.
`python -m launch.gke.manifest` prints the JobSet and the verifier Job. Bad input exits 2 with one
line on stderr and prints nothing.
"""

import json
import os
import re
import shlex
import subprocess
import textwrap

import pytest
import yaml

from runtime import exit_codes
from tests import helpers

WORKDIR = "gs://ckpt-bucket/runs/run1"
IMAGE = "us-docker.pkg.dev/my-project/repo/ckpt:tpu"
PACKAGE = "jax-checkpoint-service[gcs] @ git+https://github.com/example/ckpt"
TPU_FLAGS = ["--project=my-project", "--zone=us-east5-a", "--tpu_name=ckpt-pod", "--accelerator_type=v5litepod-16",
             "--runtime_version=v2-alpha-tpuv5-lite", f"--workdir={WORKDIR}"]
GKE_FLAGS = ["--name=ckpt-run1", f"--image={IMAGE}", f"--workdir={WORKDIR}"]
TRAINER_ARGS = ["--mesh=data=16", "--steps=5000", "--save_every_steps=500", "--resume_from=latest"]

# What an unfilled template leaves behind: <PROJECT>, TODO, ${VAR}, a Python None, {field}.
PLACEHOLDER = re.compile(r"<[A-Za-z_][-A-Za-z0-9_ .]*>|\bTODO\b|FIXME|\$\{|\bNone\b|\{[a-z_]+\}")
_SHELL_OPERATORS = set("();<>|&")


def run_recipe(module: str, *flags: str, **env) -> subprocess.CompletedProcess:
    return helpers.run_module(module, *flags, timeout=60, **env)


def tpu_script(*flags: str, trainer_args=TRAINER_ARGS) -> str:
    result = run_recipe("launch.tpu.recipe", *TPU_FLAGS, *flags, "--", *trainer_args)
    assert result.returncode == 0, result.stderr
    assert not PLACEHOLDER.search(result.stdout), PLACEHOLDER.search(result.stdout)
    syntax = subprocess.run(["bash", "-n"], input=result.stdout, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    return result.stdout


def shell_words(text: str) -> list[str]:
    """Words as bash splits them, with operators such as ;, ), ||, > and & as words of their own."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def gcloud_commands(script: str) -> list[list[str]]:
    """Each gcloud command of the script as the argument list bash passes it (comments skipped)."""
    commands = []
    for line in script.splitlines():
        if line.lstrip().startswith("#"):
            continue
        segment = []
        for word in [*shell_words(line), ";"]:
            if set(word) <= _SHELL_OPERATORS:  # ), ||, >, </dev/null's <, & ... end a command
                if "gcloud" in segment:
                    commands.append(segment[segment.index("gcloud"):])
                segment = []
            else:
                segment.append(word)
    return commands


def find(commands: list[list[str]], *prefix: str) -> list[list[str]]:
    return [c for c in commands if c[1:1 + len(prefix)] == list(prefix)]


def flag(command: list[str], name: str) -> str | None:
    values = [word.partition("=")[2] for word in command if word.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given twice in {command}"
    return values[0] if values else None


def remote(command: list[str]) -> list[str]:
    """The words of a command run on a host over ssh (its --command)."""
    return shell_words(flag(command, "command"))


def test_tpu_vm_script_puts_each_flag_in_its_command():
    script = tpu_script(f"--install={PACKAGE}", "--preemptible", "--max_restarts=7")
    commands = gcloud_commands(script)
    assert all(flag(c, "project") == "my-project" and flag(c, "zone") == "us-east5-a" for c in commands)

    [create] = find(commands, "compute", "tpus", "tpu-vm", "create")
    assert create[5] == "ckpt-pod"
    assert flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "version") == "v2-alpha-tpuv5-lite"  # tpu-vm create names it --version
    assert "--preemptible" in create and "--spot" not in create
    assert find(commands, "compute", "tpus", "tpu-vm", "list")  # the state the restart loop reads

    install, train = find(commands, "compute", "tpus", "tpu-vm", "ssh")
    for ssh in (install, train):
        assert ssh[5] == "ckpt-pod" and "--worker=all" in ssh
    assert PACKAGE in remote(install) and "jax[tpu]" in remote(install)
    words = remote(train)
    start = words.index("trainer.train")
    assert words[start - 1:start + 6] == ["-m", "trainer.train", f"--workdir={WORKDIR}", *TRAINER_ARGS]
    assert "TPU_WORKER_HOSTNAMES" in flag(train, "command")  # what runtime/distributed.py reads
    assert "jax.distributed" not in script and "--coordinator_address" not in script

    [vm] = find(commands, "compute", "instances", "create")
    assert vm[4] == "ckpt-pod-verifier" and flag(vm, "machine-type") == "e2-standard-8"
    assert flag(vm, "scopes") == "cloud-platform"  # the verifier writes verdicts to the bucket
    verify = next(c for c in find(commands, "compute", "ssh") if "trainer.verify" in flag(c, "command"))
    words = remote(verify)
    start = words.index("trainer.verify")
    assert words[start + 1:start + 4] == [f"--workdir={WORKDIR}", "--mesh=data=4", "--follow"]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in words

    assert '"$code" -ne 75' in script and '"$restarts" -gt 7' in script


def test_queued_resource_with_image_script():
    script = tpu_script(f"--image={IMAGE}", "--queued_resource", "--spot", "--verifier_vm=ckpt-check",
                        "--verifier_machine_type=n2-standard-4", "--verifier_mesh=data=2")
    commands = gcloud_commands(script)
    [create] = find(commands, "compute", "tpus", "queued-resources", "create")
    assert create[5] == "ckpt-pod" and flag(create, "node-id") == "ckpt-pod"
    assert flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "runtime-version") == "v2-alpha-tpuv5-lite"
    assert "--spot" in create
    assert not find(commands, "compute", "tpus", "tpu-vm", "create")

    install, train = find(commands, "compute", "tpus", "tpu-vm", "ssh")
    assert "--worker=all" in install and "--worker=all" in train
    assert remote(install)[-3:] == ["docker", "pull", IMAGE]
    words = remote(train)
    start = words.index(IMAGE)
    assert words[start:start + 7] == [IMAGE, "train", f"--workdir={WORKDIR}", *TRAINER_ARGS]
    assert "--privileged" in words and "TPU_WORKER_HOSTNAMES=$TPU_WORKER_HOSTNAMES" in " ".join(words)
    # A restart of this job is the same job to the workdir lease: it waits out the old lease.
    assert "JOB_ID=ckpt-pod" in " ".join(words) and "JOB_ID=$JOB_ID" in " ".join(words)

    [vm] = find(commands, "compute", "instances", "create")
    assert vm[4] == "ckpt-check" and flag(vm, "machine-type") == "n2-standard-4"
    verify = next(c for c in find(commands, "compute", "ssh", "ckpt-check") if IMAGE in flag(c, "command")
                  and "verify" in remote(c))
    words = remote(verify)
    start = words.index(IMAGE)
    assert words[start:start + 5] == [IMAGE, "verify", f"--workdir={WORKDIR}", "--mesh=data=2", "--follow"]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in words


# A fake gcloud: logs each call and answers from files, so the script's loop runs as written.
FAKE_GCLOUD = textwrap.dedent("""\
    #!/usr/bin/env bash
    d="$FAKE_GCLOUD_DIR"
    echo "$*" >> "$d/calls"
    case "$1 $2 $3 $4" in
      "compute tpus tpu-vm list" | "compute tpus queued-resources list") cat "$d/state" 2>/dev/null; exit 0 ;;
      "compute tpus tpu-vm create") echo READY > "$d/state"; exit 0 ;;
      "compute tpus queued-resources create") echo ACTIVE > "$d/state"; exit 0 ;;
      "compute tpus tpu-vm delete" | "compute tpus queued-resources delete") rm -f "$d/state"; exit 0 ;;
      "compute tpus tpu-vm ssh")
        case "$*" in *TPU_WORKER_HOSTNAMES*) ;; *) exit 0 ;; esac
        read -r code state < <(head -n 1 "$d/trainer")
        sed -i 1d "$d/trainer"
        if [ -n "$state" ]; then echo "$state" > "$d/state"; fi
        exit "$code" ;;
      "compute instances describe "*) [ -f "$d/vm" ]; exit ;;
      "compute instances create "*) touch "$d/vm"; exit 0 ;;
      "compute ssh "*) case "$*" in *--follow*) exit "$(cat "$d/verifier")" ;; esac; exit 0 ;;
    esac
    echo "fake gcloud: unexpected call: $*" >&2
    exit 99
    """)


@pytest.fixture
def fake_gcloud(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "gcloud"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)

    def run(trainer_exits: list[str], verifier_exit: int = 0, *flags: str):
        (state / "trainer").write_text("".join(f"{line}\n" for line in trainer_exits))
        (state / "verifier").write_text(str(verifier_exit))
        result = run_recipe("launch.tpu.recipe", *TPU_FLAGS, f"--image={IMAGE}", "--spot", "--nodry_run", *flags,
                            "--", *TRAINER_ARGS, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                            FAKE_GCLOUD_DIR=str(state))
        calls = (state / "calls").read_text().splitlines()
        assert not any(line.startswith("fake gcloud") for line in result.stderr.splitlines()), result.stderr
        return result, calls
    return run


def count(calls: list[str], prefix: str, containing: str = "") -> int:
    return sum(1 for call in calls if call.startswith(prefix) and containing in call)


@pytest.mark.parametrize("trainer_exits, verifier_exit, flags, code, creates, deletes, runs", [
    # preempted with its checkpoint committed, TPU still up: run again on the same TPU
    (["75", "0"], 0, [], 0, 1, 0, 2),
    # the spot TPU itself was taken (ssh lost): replace it, run again
    (["255 PREEMPTED", "0"], 0, [], 0, 2, 1, 2),
    # bad input with the TPU up: a restart would fail the same way
    (["2"], 0, [], exit_codes.BAD_INPUT, 1, 0, 1),
    (["1"], 0, [], exit_codes.FAILURE, 1, 0, 1),
    # preempted more often than allowed
    (["75", "75"], 0, ["--max_restarts=1"], exit_codes.PREEMPTED, 1, 0, 2),
    # the trainer finished but a verdict failed: the run's exit says so
    (["0"], 1, [], exit_codes.FAILURE, 1, 0, 1),
], ids=["preempted", "tpu-lost", "bad-input", "failure", "max-restarts", "verdict-failed"])
def test_restart_loop_against_fake_gcloud(fake_gcloud, trainer_exits, verifier_exit, flags, code, creates,
                                          deletes, runs):
    result, calls = fake_gcloud(trainer_exits, verifier_exit, *flags)
    assert result.returncode == code, result.stderr
    assert count(calls, "compute tpus tpu-vm create ckpt-pod") == creates
    assert count(calls, "compute tpus tpu-vm delete ckpt-pod") == deletes
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "TPU_WORKER_HOSTNAMES") == runs
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "docker pull") == runs  # installed before each run
    assert count(calls, "compute instances create ckpt-pod-verifier") == 1
    assert count(calls, "compute ssh ckpt-pod-verifier", "--follow") == 1
    stopped = count(calls, "compute ssh ckpt-pod-verifier", "docker stop ckpt-verifier")
    assert stopped == (0 if trainer_exits[-1] == "0" else 1)  # a run that gives up stops its verifier


def test_suspended_queued_resource_is_replaced(fake_gcloud):
    result, calls = fake_gcloud(["255 SUSPENDED", "75", "0"], 0, "--queued_resource")
    assert result.returncode == 0, result.stderr
    assert count(calls, "compute tpus queued-resources create ckpt-pod") == 2
    assert count(calls, "compute tpus queued-resources delete ckpt-pod --force") == 1
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "TPU_WORKER_HOSTNAMES") == 3
    assert "restart 2 of 20" in result.stderr


def test_nodry_run_without_gcloud_exits_2(tmp_path):
    result = run_recipe("launch.tpu.recipe", *TPU_FLAGS, f"--image={IMAGE}", "--nodry_run", PATH=str(tmp_path))
    assert result.returncode == exit_codes.BAD_INPUT
    assert result.stderr.strip() == "error: gcloud is not on PATH; use --dry_run to print the commands instead"


@pytest.mark.parametrize("flags, trainer_args, message", [
    ([f"--image={IMAGE}", "--workdir=/tmp/run"], [], "must be a gs://BUCKET/PATH"),
    ([f"--image={IMAGE}", "--workdir="], [], "--workdir is required"),
    ([f"--image={IMAGE}", "--tpu_name="], [], "--tpu_name is required"),
    ([f"--image={IMAGE}", "--tpu_name=Ckpt_Pod"], [], "--tpu_name='Ckpt_Pod'"),
    ([f"--image={IMAGE}", "--accelerator_type=v5lite"], [], "--accelerator_type='v5lite' is not valid"),
    ([f"--image={IMAGE}", "--project="], [], "--project is required"),
    ([f"--image={IMAGE}", "--zone=us-east5"], [], "--zone='us-east5' is not valid"),
    ([], [], "exactly one of --image and --install"),
    ([f"--image={IMAGE}", f"--install={PACKAGE}"], [], "exactly one of --image and --install"),
    (["--image=<IMAGE>"], [], "is not a container image"),
    ([f"--image={IMAGE}", "--spot", "--preemptible"], [], "at most one of --spot and --preemptible"),
    ([f"--image={IMAGE}", "--queued_resource", "--preemptible"], [], "not available for queued resources"),
    ([f"--image={IMAGE}", "--verifier_mesh=data=x"], [], "positive integer size"),
    ([f"--image={IMAGE}"], ["--workdir=gs://other/run"], "do not pass --workdir to the trainer"),
    ([f"--image={IMAGE}"], ["--num_processes=4"], "do not pass --num_processes"),
    ([f"--image={IMAGE}"], ["5000"], "must each be --name=value"),
    ([f"--image={IMAGE}"], ["--preemption_grace_secs=soon"], "--preemption_grace_secs='soon' is not a number"),
    ([f"--image={IMAGE}", "--max_restarts=-1"], [], "max_restarts"),
    ([f"--image={IMAGE}", "--zonee=us-east5-a"], [], "zonee"),
])
def test_tpu_bad_input_exits_2_with_one_line(flags, trainer_args, message):
    result = run_recipe("launch.tpu.recipe", *TPU_FLAGS, *flags, "--", *trainer_args)
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""


def gke_documents(*flags: str, trainer_args=TRAINER_ARGS) -> list[dict]:
    result = run_recipe("launch.gke.manifest", *GKE_FLAGS, *flags, "--", *trainer_args)
    assert result.returncode == 0, result.stderr
    assert not PLACEHOLDER.search(result.stdout), PLACEHOLDER.search(result.stdout)
    assert result.stdout.startswith("# ")  # kubectl reads a stream starting with '{' as one JSON object
    documents = list(yaml.safe_load_all(result.stdout))
    # Each document is JSON after its comment lines: no YAML library is needed to write or read it.
    as_json = [json.loads("\n".join(line for line in part.splitlines() if not line.startswith("#")))
               for part in result.stdout.split("\n---\n")]
    assert as_json == documents
    return documents


def test_jobset_one_pod_per_host_and_a_verifier_job():
    jobset, verifier = gke_documents("--tpu_accelerator=tpu-v5-lite-podslice", "--tpu_topology=4x4",
                                     "--chips_per_host=4", "--max_restarts=5", "--termination_grace_secs=150",
                                     "--spot", "--service_account=ckpt-sa",
                                     trainer_args=[*TRAINER_ARGS, "--preemption_grace_secs=90"])
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["metadata"]["name"] == "ckpt-run1"
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5
    assert policy["rules"] == [{"action": "RestartJobSetAndIgnoreMaxRestarts",
                                "onJobFailureReasons": ["PodFailurePolicy"]}]
    [workers] = jobset["spec"]["replicatedJobs"]
    job = workers["template"]["spec"]
    assert workers["replicas"] == 1
    assert job["parallelism"] == job["completions"] == 4  # 16 chips, 4 per host
    assert job["backoffLimit"] == 0  # any failed pod fails the Job, so JobSet restarts the whole set
    preempted, disrupted = job["podFailurePolicy"]["rules"]
    assert preempted == {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                              "values": [exit_codes.PREEMPTED]}}
    assert disrupted["action"] == "FailJob" and disrupted["onPodConditions"][0]["type"] == "DisruptionTarget"
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "ckpt-sa"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "4x4", "cloud.google.com/gke-spot": "true"}
    assert pod["terminationGracePeriodSeconds"] == 150 > 90
    [trainer] = pod["containers"]
    assert trainer["image"] == IMAGE
    assert trainer["args"] == ["train", f"--workdir={WORKDIR}", *TRAINER_ARGS, "--preemption_grace_secs=90"]
    assert trainer["resources"]["limits"] == trainer["resources"]["requests"] == {"google.com/tpu": 4}

    assert (verifier["apiVersion"], verifier["kind"]) == ("batch/v1", "Job")
    assert verifier["metadata"]["name"] == "ckpt-run1-verifier"
    vpod = verifier["spec"]["template"]["spec"]
    [container] = vpod["containers"]
    assert container["image"] == IMAGE
    assert container["args"] == ["verify", f"--workdir={WORKDIR}", "--mesh=data=4", "--follow"]
    assert {"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=4"} in container["env"]
    assert {"name": "JAX_PLATFORMS", "value": "cpu"} in container["env"]
    assert "google.com/tpu" not in container["resources"]["limits"] and "nodeSelector" not in vpod
    assert verifier["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [exit_codes.BAD_INPUT]


@pytest.mark.parametrize("accelerator, topology, chips_per_host, hosts", [
    ("tpu-v5p-slice", "2x2x4", 4, 4),
    ("tpu-v5-lite-podslice", "2x4", 8, 1),
    ("tpu-v6e-slice", "8x8", 4, 16),
])
def test_jobset_hosts_follow_the_topology(accelerator, topology, chips_per_host, hosts):
    jobset, _ = gke_documents(f"--tpu_accelerator={accelerator}", f"--tpu_topology={topology}",
                              f"--chips_per_host={chips_per_host}")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts
    pod = job["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": chips_per_host}
    assert pod["terminationGracePeriodSeconds"] == 120  # the default, over the trainer's default 60 s
    assert "serviceAccountName" not in pod and "cloud.google.com/gke-spot" not in pod["nodeSelector"]


@pytest.mark.parametrize("flags, trainer_args, message", [
    (["--termination_grace_secs=60"], [], "must exceed the trainer's --preemption_grace_secs=60"),
    ([], ["--preemption_grace_secs=300"], "--termination_grace_secs=120 must exceed"),
    (["--tpu_topology=4x4x4"], [], "has 3 dimensions but tpu-v5-lite-podslice slices have 2"),
    (["--tpu_topology=3x3"], [], "9 chips, not a multiple of --chips_per_host=4"),
    (["--tpu_topology=4by4"], [], "--tpu_topology='4by4'"),
    (["--workdir=/data/run1"], [], "must be a gs://BUCKET/PATH"),
    (["--image="], [], "--image is required"),
    (["--name=Ckpt"], [], "--name='Ckpt' is not valid"),
    (["--verifier_memory=lots"], [], "--verifier_memory='lots'"),
    ([], ["--workdir=gs://other/run"], "do not pass --workdir"),
])
def test_gke_bad_input_exits_2_with_one_line(flags, trainer_args, message):
    result = run_recipe("launch.gke.manifest", *GKE_FLAGS, *flags, "--", *trainer_args)
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""
