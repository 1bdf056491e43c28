"""GKE manifests for one run: a JobSet with one trainer pod per TPU host, and a CPU verifier Job.

  python -m launch.gke.manifest --name=ckpt-run1 --image=us-docker.pkg.dev/P/repo/ckpt:tpu \\
      --workdir=gs://BUCKET/run1 --tpu_accelerator=tpu-v5-lite-podslice --tpu_topology=4x4 \\
      -- --mesh=data=16 --steps=10000 --save_every_steps=500 | kubectl apply -f -

Prints two documents separated by `---`, each JSON (a subset of YAML, so kubectl reads it and no
YAML library is needed) after a few `#` comment lines:

  JobSet (jobset.x-k8s.io/v1alpha2): one replicated Job whose parallelism = completions = the
  number of TPU hosts (chips in --tpu_topology / --chips_per_host), pinned to the slice by the
  gke-tpu-accelerator/topology node selectors, each pod asking for --chips_per_host google.com/tpu.
  GKE injects TPU_WORKER_HOSTNAMES and TPU_WORKER_ID into such pods, so runtime/distributed.py
  starts jax.distributed with no arguments. terminationGracePeriodSeconds must exceed the
  trainer's --preemption_grace_secs: SIGTERM -> agree on a step -> save -> commit -> exit 75.

  How exits are treated: backoffLimit 0, so any failed pod fails its Job and JobSet restarts the
  whole set (every pod resumes from the latest committed checkpoint). The Job's podFailurePolicy
  turns exit 75 (preempted, its checkpoint committed) and a disruption (node preempted, drained)
  into the PodFailurePolicy failure reason, which the JobSet rule restarts without counting
  against --max_restarts. Any other exit (1 failure, 2 bad input, a kill) is restarted at most
  --max_restarts times, then the JobSet fails: a bad flag fails fast on every attempt.

  Job (batch/v1): the verifier, `verifier.verify --follow` on --verifier_mesh fake CPU devices,
  outside the JobSet so JobSet restarts leave it running; it exits once the run's final
  checkpoint is verified (0 all passed, 1 a verdict failed). Exit 2 fails it at once; a
  disruption is retried without counting; anything else up to --verifier_backoff_limit times.
"""

import json
import re
import shlex
import sys

from absl import flags

from runtime import entry, exit_codes
from launch.tpu import common

NAME = flags.DEFINE_string("name", None, "JobSet name (the verifier Job is NAME-verifier).")
NAMESPACE = flags.DEFINE_string("namespace", "default", "Kubernetes namespace.")
IMAGE = flags.DEFINE_string("image", None, "Container image built with docker/Dockerfile (JAX_EXTRA=tpu).")
WORKDIR = flags.DEFINE_string("workdir", None, "The run's gs://BUCKET/PATH (checkpoints, verdicts, metrics).")
TPU_ACCELERATOR = flags.DEFINE_string("tpu_accelerator", "tpu-v5-lite-podslice",
                                      "Value of the cloud.google.com/gke-tpu-accelerator node label.")
TPU_TOPOLOGY = flags.DEFINE_string("tpu_topology", "4x4", "Value of the cloud.google.com/gke-tpu-topology node "
                                   "label: chips per dimension, e.g. 4x4 (v5e, v6e) or 2x2x4 (v4, v5p).")
CHIPS_PER_HOST = flags.DEFINE_integer("chips_per_host", 4, "TPU chips of one host (its google.com/tpu count).",
                                      lower_bound=1)
SPOT = flags.DEFINE_boolean("spot", False, "Schedule on Spot TPU nodes (cloud.google.com/gke-spot).")
MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "JobSet restarts for failures other than preemption.",
                                    lower_bound=0)
TERMINATION_GRACE_SECS = flags.DEFINE_integer(
    "termination_grace_secs", 120, "Pod terminationGracePeriodSeconds; must exceed the trainer's "
    "--preemption_grace_secs so the final save can commit.", lower_bound=1)
SERVICE_ACCOUNT = flags.DEFINE_string("service_account", None, "Kubernetes service account with access to the "
                                      "bucket (Workload Identity); default: the namespace's default.")
VERIFIER_MESH = flags.DEFINE_string("verifier_mesh", "data=4",
                                    "The verifier's --mesh, on as many fake CPU devices as it names.")
VERIFIER_MEMORY = flags.DEFINE_string("verifier_memory", "16Gi", "Memory request and limit of the verifier pod.")
VERIFIER_BACKOFF_LIMIT = flags.DEFINE_integer("verifier_backoff_limit", 3, "Retries of a crashed verifier.",
                                              lower_bound=0)

# JobSet names become pod hostnames NAME-workers-0-<index>, which must stay within 63 characters.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_ACCELERATOR = re.compile(r"tpu-[a-z0-9][-a-z0-9]*")
_TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}")
_QUANTITY = re.compile(r"[1-9][0-9]*(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?")
# Topology dimensions of the slice types GKE names today; other types are checked for format only.
_TOPOLOGY_DIMS = {"tpu-v4-podslice": 3, "tpu-v5p-slice": 3, "tpu-v5-lite-podslice": 2, "tpu-v6e-slice": 2}

TRAINER_CONTAINER = "trainer"
VERIFIER_CONTAINER = "verifier"


def num_hosts(accelerator: str, topology: str, chips_per_host: int) -> int:
    """TPU hosts of the slice: its chips (the topology's product) over the chips of one host."""
    if not _ACCELERATOR.fullmatch(accelerator):
        raise common.RecipeError(f"--tpu_accelerator={accelerator!r} is not a GKE TPU type, e.g. tpu-v5-lite-podslice")
    if not _TOPOLOGY.fullmatch(topology):
        raise common.RecipeError(f"--tpu_topology={topology!r} must be chips per dimension, e.g. 4x4 or 2x2x4")
    dims = [int(d) for d in topology.split("x")]
    if accelerator in _TOPOLOGY_DIMS and len(dims) != _TOPOLOGY_DIMS[accelerator]:
        raise common.RecipeError(f"--tpu_topology={topology} has {len(dims)} dimensions but {accelerator} "
                                 f"slices have {_TOPOLOGY_DIMS[accelerator]}")
    chips = 1
    for d in dims:
        chips *= d
    if chips % chips_per_host:
        raise common.RecipeError(f"--tpu_topology={topology} has {chips} chips, not a multiple of "
                                 f"--chips_per_host={chips_per_host}")
    return chips // chips_per_host


def _check(pattern: re.Pattern, flag: str, value: str | None) -> str:
    if not value:
        raise common.RecipeError(f"--{flag} is required")
    if not pattern.fullmatch(value):
        raise common.RecipeError(f"--{flag}={value!r} is not valid")
    return value


def _pod_spec(containers: list[dict], service_account: str | None, **fields) -> dict:
    spec = {"restartPolicy": "Never", **fields, "containers": containers}
    if service_account:
        spec["serviceAccountName"] = service_account
    return spec


def jobset(name: str, namespace: str, image: str, workdir: str, accelerator: str, topology: str,
           chips_per_host: int, spot: bool, max_restarts: int, termination_grace_secs: int,
           service_account: str | None, trainer_args: tuple[str, ...]) -> dict:
    hosts = num_hosts(accelerator, topology, chips_per_host)
    grace = common.preemption_grace_secs(trainer_args)
    if not termination_grace_secs > grace:
        raise common.RecipeError(f"--termination_grace_secs={termination_grace_secs} must exceed the trainer's "
                                 f"--preemption_grace_secs={grace:g}, or the final save is killed before it commits")
    node_selector = {"cloud.google.com/gke-tpu-accelerator": accelerator,
                     "cloud.google.com/gke-tpu-topology": topology}
    if spot:
        node_selector["cloud.google.com/gke-spot"] = "true"
    tpus = {"google.com/tpu": chips_per_host}
    trainer = {"name": TRAINER_CONTAINER, "image": image,
               "args": ["train", f"--workdir={workdir}", *trainer_args],
               # The workdir lease's job id: a restarted JobSet's pods wait for the old pods' lease
               # to expire instead of being refused (checkpointing/_src/lease.py).
               "env": [{"name": "JOB_ID", "value": f"{namespace}/{name}"}],
               "resources": {"requests": tpus, "limits": tpus}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        # One slice per Job: the exclusive-topology annotation keeps two Jobs off one node pool.
        "metadata": {"name": name, "namespace": namespace,
                     "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
        "spec": {
            "failurePolicy": {
                "maxRestarts": max_restarts,
                # Exit 75 and disruptions reach JobSet as reason PodFailurePolicy (below): restart for free.
                "rules": [{"action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [{
                "name": "workers",
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": hosts,
                    "completions": hosts,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "podFailurePolicy": {"rules": [
                        {"action": "FailJob", "onExitCodes": {"containerName": TRAINER_CONTAINER, "operator": "In",
                                                              "values": [exit_codes.PREEMPTED]}},
                        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    ]},
                    "template": {"spec": _pod_spec([trainer], service_account, nodeSelector=node_selector,
                                                   terminationGracePeriodSeconds=termination_grace_secs)},
                }},
            }],
        },
    }


def verifier_job(name: str, namespace: str, image: str, workdir: str, mesh: str, memory: str,
                 backoff_limit: int, service_account: str | None) -> dict:
    devices = common.verifier_devices(mesh)
    resources = {"cpu": str(devices), "memory": _check(_QUANTITY, "verifier_memory", memory)}
    verifier = {"name": VERIFIER_CONTAINER, "image": image,
                "args": ["verify", f"--workdir={workdir}", f"--mesh={mesh}", "--follow"],
                "env": [{"name": "JAX_PLATFORMS", "value": "cpu"},
                        {"name": "XLA_FLAGS", "value": f"--xla_force_host_platform_device_count={devices}"}],
                "resources": {"requests": resources, "limits": resources}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-verifier", "namespace": namespace},
        "spec": {
            "backoffLimit": backoff_limit,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": VERIFIER_CONTAINER, "operator": "In",
                                                      "values": [exit_codes.BAD_INPUT]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"spec": _pod_spec([verifier], service_account, terminationGracePeriodSeconds=30)},
        },
    }


def manifests_from_flags(trainer_args: list[str]) -> list[dict]:
    """[JobSet, verifier Job] from the parsed flags; RecipeError (a ValueError) names the first bad flag."""
    name = _check(_NAME, "name", NAME.value)
    namespace = _check(_NAMESPACE, "namespace", NAMESPACE.value)
    if not IMAGE.value:
        raise common.RecipeError("--image is required (built with docker/Dockerfile, JAX_EXTRA=tpu)")
    image = common.check_image("image", IMAGE.value)
    workdir = common.check_workdir(WORKDIR.value)
    service_account = SERVICE_ACCOUNT.value and _check(_NAMESPACE, "service_account", SERVICE_ACCOUNT.value)
    args = common.check_trainer_args(trainer_args)
    return [
        jobset(name, namespace, image, workdir, TPU_ACCELERATOR.value, TPU_TOPOLOGY.value, CHIPS_PER_HOST.value,
               SPOT.value, MAX_RESTARTS.value, TERMINATION_GRACE_SECS.value, service_account, args),
        verifier_job(name, namespace, image, workdir, VERIFIER_MESH.value, VERIFIER_MEMORY.value,
                     VERIFIER_BACKOFF_LIMIT.value, service_account),
    ]


_DOCUMENT_COMMENTS = {
    "JobSet": "exit 75 and disruptions restart the whole set without counting; other failures count "
              "against maxRestarts",
    "Job": "the verifier, verifier.verify --follow, outside the JobSet so its restarts leave it running",
}


def render(documents: list[dict], argv: list[str]) -> str:
    """One multi-document YAML stream: per document a comment line, then the document as JSON.

    The stream must not start with '{': kubectl would then read it as a single JSON object and stop
    at the first `---`. Starting with a comment line makes it read YAML, which JSON is a subset of.
    """
    header = f"# Generated by: python -m launch.gke.manifest {shlex.join(argv)}".rstrip()
    parts = [f"# {doc['kind']} {doc['metadata']['name']}: {_DOCUMENT_COMMENTS[doc['kind']]}\n"
             + json.dumps(doc, indent=2) for doc in documents]
    return header + "\n" + "\n---\n".join(parts) + "\n"


def main(argv: list[str]) -> None:
    """Bad input raises ValueError (RecipeError, or ConfigError for the verifier mesh): entry.run
    turns it into exit 2 and one line, before anything is printed."""
    sys.stdout.write(render(manifests_from_flags(argv[1:]), sys.argv[1:]))


if __name__ == "__main__":
    entry.run(main, takes_arguments=True)
