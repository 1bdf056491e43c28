"""The GKE recipe as a user runs it, read back the way kubectl would read it.

`python -m launch.gke.manifest` prints the JobSet and the verifier Job. Bad input exits 2 with one
line on stderr and prints nothing. No JAX is imported in these subprocesses: they stay fast.
"""

import json
import re
import subprocess

import pytest
import yaml

from runtime import exit_codes
from tests import helpers

WORKDIR = "gs://ckpt-bucket/runs/run1"
IMAGE = "us-docker.pkg.dev/my-project/repo/ckpt:tpu"
GKE_FLAGS = ["--name=ckpt-run1", f"--image={IMAGE}", f"--workdir={WORKDIR}"]
TRAINER_ARGS = ["--mesh=data=16", "--steps=5000", "--save_every_steps=500", "--resume_from=latest"]

# What an unfilled template leaves behind: <PROJECT>, TODO, ${VAR}, a Python None, {field}.
PLACEHOLDER = re.compile(r"<[A-Za-z_][-A-Za-z0-9_ .]*>|\bTODO\b|FIXME|\$\{|\bNone\b|\{[a-z_]+\}")


def run_manifest(*flags: str) -> subprocess.CompletedProcess:
    return helpers.run_module("launch.gke.manifest", *GKE_FLAGS, *flags, timeout=60)


def gke_documents(*flags: str, trainer_args=TRAINER_ARGS) -> list[dict]:
    result = run_manifest(*flags, "--", *trainer_args)
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
    result = run_manifest(*flags, "--", *trainer_args)
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""
