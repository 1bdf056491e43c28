#!/usr/bin/env bash
# A Cloud TPU pod run through gcloud: the TPU, the trainer on every worker with a restart loop,
# and the verifier on its own small VM.
#
#   python -m launch.tpu.recipe --project=P ... -- TRAINER FLAGS > run.sh && bash run.sh
#
# The recipe (launch/tpu/recipe.py) validates its flags and prints the variables below followed
# by this file; --nodry_run runs that same text. Every input is one of these variables:
#   PROJECT, ZONE                       project and zone of the TPU and of the verifier VM
#   TPU_NAME                            TPU VM name (also the queued resource's name and node id)
#   ACCELERATOR_TYPE, RUNTIME_VERSION   e.g. v5litepod-16, v2-alpha-tpuv5-lite
#   QUEUED_RESOURCE, SPOT, PREEMPTIBLE  true or false: how the TPU is asked for
#   WORKDIR                             gs://BUCKET/PATH, seen by every host and the verifier
#   IMAGE, INSTALL                      exactly one non-empty: a container image, or a pip
#                                       requirement installed in a virtual environment per host
#   TRAINER_FLAGS                       the trainer's flags as shell words (may be empty)
#   VERIFIER_VM, VERIFIER_MACHINE_TYPE  the verifier's VM
#   VERIFIER_MESH, VERIFIER_DEVICES     its --mesh, on this many fake CPU devices
#   MAX_RESTARTS                        restarts after a preemption before giving up
#   EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_PREEMPTED   the codes of runtime/exit_codes.py
#
# The run:
#  1. creates the verifier VM if missing, installs the image or package there and starts
#     `verifier.verify --follow` on it in the background;
#  2. makes sure the TPU is up: created when missing, deleted and created again when preempted
#     (Spot and preemptible TPUs cannot be restarted);
#  3. installs the image or package on every worker (`tpu-vm ssh --worker=all`);
#  4. runs the trainer on every worker, one process per host. Each worker first exports
#     TPU_WORKER_ID and TPU_WORKER_HOSTNAMES from the metadata server: runtime/distributed.py
#     starts jax.distributed only when that variable lists several hosts, and a TPU VM does not
#     set it;
#  5. on EXIT_PREEMPTED (its checkpoint committed), or any exit once the TPU itself is gone, goes
#     back to 2: the trainer resumes from the latest committed checkpoint, at most MAX_RESTARTS
#     times. Any other exit with the TPU still up stops the run: a blind restart would fail the
#     same way. `--worker=all` exits with the first non-zero worker code in worker order; a
#     preemption makes every worker exit EXIT_PREEMPTED together;
#  6. after the trainer's EXIT_OK, waits for the verifier to verify the final checkpoint and
#     exits with its code (EXIT_OK: every committed step passed, EXIT_FAILURE: a verdict failed).
set -euo pipefail

: "${PROJECT:?PROJECT is not set}" "${ZONE:?ZONE is not set}" "${TPU_NAME:?TPU_NAME is not set}"
: "${ACCELERATOR_TYPE:?ACCELERATOR_TYPE is not set}" "${RUNTIME_VERSION:?RUNTIME_VERSION is not set}"
: "${QUEUED_RESOURCE:?QUEUED_RESOURCE is not set}" "${SPOT:?SPOT is not set}"
: "${PREEMPTIBLE:?PREEMPTIBLE is not set}" "${WORKDIR:?WORKDIR is not set}"
: "${IMAGE?IMAGE is not set (empty with INSTALL)}" "${INSTALL?INSTALL is not set (empty with IMAGE)}"
: "${TRAINER_FLAGS?TRAINER_FLAGS is not set (it may be empty)}"
: "${VERIFIER_VM:?VERIFIER_VM is not set}" "${VERIFIER_MACHINE_TYPE:?VERIFIER_MACHINE_TYPE is not set}"
: "${VERIFIER_MESH:?VERIFIER_MESH is not set}" "${VERIFIER_DEVICES:?VERIFIER_DEVICES is not set}"
: "${MAX_RESTARTS:?MAX_RESTARTS is not set}"
: "${EXIT_OK:?EXIT_OK is not set}" "${EXIT_FAILURE:?EXIT_FAILURE is not set}"
: "${EXIT_BAD_INPUT:?EXIT_BAD_INPUT is not set}" "${EXIT_PREEMPTED:?EXIT_PREEMPTED is not set}"
if { [ -n "$IMAGE" ] && [ -n "$INSTALL" ]; } || { [ -z "$IMAGE" ] && [ -z "$INSTALL" ]; }; then
  echo "run.sh: set exactly one of IMAGE and INSTALL" >&2
  exit "$EXIT_BAD_INPUT"
fi

# --- gcloud commands ----------------------------------------------------------------------------

gc() {  # every gcloud command names the project and the zone
  gcloud "$@" --project="$PROJECT" --zone="$ZONE"
}

if [ "$QUEUED_RESOURCE" = true ]; then
  tpu_api=(compute tpus queued-resources)
  tpu_create=(create "$TPU_NAME" --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE"
              --runtime-version="$RUNTIME_VERSION")
  tpu_list=(list --filter="name~/queuedResources/$TPU_NAME\$" --format="value(state.state)")
  tpu_delete=(delete "$TPU_NAME" --force --quiet)  # --force: its TPU node too
  up_states=ACTIVE dead_states=SUSPENDED
else
  tpu_api=(compute tpus tpu-vm)
  tpu_create=(create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION")
  tpu_list=(list --filter="name~/nodes/$TPU_NAME\$" --format="value(state)")
  tpu_delete=(delete "$TPU_NAME" --quiet)
  up_states=READY dead_states="PREEMPTED TERMINATED"
fi
if [ "$SPOT" = true ]; then tpu_create+=(--spot); fi
if [ "$PREEMPTIBLE" = true ]; then tpu_create+=(--preemptible); fi
ssh_workers=(compute tpus tpu-vm ssh "$TPU_NAME" --worker=all --quiet)
ssh_vm=(compute ssh "$VERIFIER_VM" --quiet)
# Container-Optimized OS comes with docker; Debian 12 with Python 3.11 (the package needs >= 3.10).
if [ -n "$IMAGE" ]; then
  vm_image=(--image-family=cos-stable --image-project=cos-cloud)
else
  vm_image=(--image-family=debian-12 --image-project=debian-cloud)
fi

# --- commands run on the hosts (one string each, parsed again by the host's shell) --------------

quote() {  # quote WORD...: the words as one line for the host's shell
  local line
  printf -v line '%q ' "$@"
  echo "${line% }"
}

venv="\$HOME/ckpt-venv"  # where INSTALL goes on each host (expanded by the host's shell)
pidfile=/tmp/ckpt-verifier.pid
metadata="http://metadata.google.internal/computeMetadata/v1/instance/attributes"
curl="curl -sf -H Metadata-Flavor:Google"
# JAX reads TPU_WORKER_ID whenever TPU_WORKER_HOSTNAMES is set; the endpoints are either hostnames
# or name:id:ip triples, and the sed keeps the last field of each. JOB_ID is the workdir lease's
# job id: a restart of this TPU job waits for the old lease to expire instead of being refused
# (checkpointing/_src/lease.py).
pod_env="set -o pipefail && TPU_WORKER_ID=\$($curl $metadata/agent-worker-number) && \
TPU_WORKER_HOSTNAMES=\$($curl $metadata/worker-network-endpoints | sed \"s/[^,]*://g\") && \
JOB_ID=$(quote "$TPU_NAME") && export TPU_WORKER_ID TPU_WORKER_HOSTNAMES JOB_ID"
trainer_flags="$(quote "--workdir=$WORKDIR")${TRAINER_FLAGS:+ $TRAINER_FLAGS}"
verifier_flags="$(quote "--workdir=$WORKDIR" "--mesh=$VERIFIER_MESH" --follow)"
verifier_env=(JAX_PLATFORMS=cpu "XLA_FLAGS=--xla_force_host_platform_device_count=$VERIFIER_DEVICES")

if [ -n "$IMAGE" ]; then
  image="$(quote "$IMAGE")"
  worker_install="sudo docker pull $image"
  vm_install="docker pull $image"
  registry="${IMAGE%%/*}"  # Artifact Registry and Container Registry need docker credentials
  if [[ "$IMAGE" == */* ]] && [[ "$registry" == *docker.pkg.dev || "$registry" == gcr.io ||
                                 "$registry" == *.gcr.io ]]; then
    worker_install="sudo gcloud auth configure-docker $(quote "$registry") --quiet && $worker_install"
    vm_install="docker-credential-gcr configure-docker --registries=$(quote "$registry") && $vm_install"
  fi
  # Named, so a container left from an attempt whose ssh session was lost is removed first.
  # sudo drops the environment, so the variables are passed by value.
  trainer="$pod_env && { sudo docker rm -f ckpt-trainer >/dev/null 2>&1; exec sudo docker run --rm \
--name=ckpt-trainer --privileged --net=host -e TPU_WORKER_ID=\$TPU_WORKER_ID \
-e TPU_WORKER_HOSTNAMES=\$TPU_WORKER_HOSTNAMES -e JOB_ID=\$JOB_ID $image train $trainer_flags; }"
  verifier="docker rm -f ckpt-verifier >/dev/null 2>&1; exec docker run --rm --name=ckpt-verifier \
-e ${verifier_env[0]} -e ${verifier_env[1]} $image verify $verifier_flags"
  verifier_stop="docker stop ckpt-verifier"
else
  pip_install="[ -x $venv/bin/pip ] || { sudo apt-get -qq update && sudo apt-get -qq install -y python3-venv \
&& python3 -m venv $venv; } && $venv/bin/pip install -q --upgrade pip && $venv/bin/pip install -q"
  worker_install="$pip_install $(quote "$INSTALL" "jax[tpu]")"
  vm_install="$pip_install $(quote "$INSTALL")"
  trainer="$pod_env && exec $venv/bin/python -m trainer.train $trainer_flags"
  # The pid file lets stop() end exactly this process with SIGTERM (exec keeps the shell's pid).
  verifier="echo \$\$ > $pidfile && ${verifier_env[*]} exec $venv/bin/python -m verifier.verify $verifier_flags"
  verifier_stop="kill -TERM \$(cat $pidfile)"
fi

# --- steps --------------------------------------------------------------------------------------

retry() {  # retry WHAT COMMAND...: a fresh VM's sshd and keys take a while to come up
  local what="$1" try
  shift
  for try in 1 2 3 4 5; do
    "$@" && return 0
    echo "attempt $try of 5 failed: $what; retrying in 20s" >&2
    sleep 20
  done
  return 1
}

is_one_of() {  # is_one_of WORD "WORDS...": whether WORD is one of the space-separated WORDS
  case " $2 " in *" $1 "*) return 0 ;; esac
  return 1
}

tpu_state() {  # the TPU's state word; MISSING when absent, UNKNOWN when the API call failed
  local state
  state="$(gc "${tpu_api[@]}" "${tpu_list[@]}")" || { echo UNKNOWN; return; }
  if [ -n "$state" ]; then echo "$state"; else echo MISSING; fi
}

ensure_tpu() {  # returns once the TPU is up; a preempted one cannot be restarted, only replaced
  local state unknown=0
  while :; do
    state="$(tpu_state)"
    if is_one_of "$state" "$up_states"; then return 0; fi
    if is_one_of "$state" "$dead_states"; then
      echo "TPU $TPU_NAME is $state: deleting it to create it again" >&2
      gc "${tpu_api[@]}" "${tpu_delete[@]}" || return 1
      continue
    fi
    case "$state" in
      MISSING) echo "creating TPU $TPU_NAME" >&2; gc "${tpu_api[@]}" "${tpu_create[@]}" || return 1 ;;
      FAILED) echo "TPU $TPU_NAME is $state" >&2; return 1 ;;
      UNKNOWN)
        unknown=$((unknown + 1))
        if [ "$unknown" -ge 10 ]; then echo "cannot read the state of TPU $TPU_NAME" >&2; return 1; fi
        sleep 30 ;;
      *) sleep 30 ;;  # creating, provisioning, waiting for capacity, deleting
    esac
  done
}


start_verifier() {
  gc compute instances describe "$VERIFIER_VM" --format="value(status)" >/dev/null 2>&1 ||
    gc compute instances create "$VERIFIER_VM" --machine-type="$VERIFIER_MACHINE_TYPE" "${vm_image[@]}" \
      --scopes=cloud-platform || return 1  # cloud-platform: the verifier writes verdicts to the bucket
  retry "installing the verifier" gc "${ssh_vm[@]}" --command="$vm_install" || return 1
  gc "${ssh_vm[@]}" --command="$verifier" </dev/null &
  verifier_pid=$!
}

cleanup_hint() {
  echo "afterwards, to stop paying for them: gcloud ${tpu_api[*]} ${tpu_delete[*]} --project=$PROJECT" \
    "--zone=$ZONE; gcloud compute instances delete $VERIFIER_VM --quiet --project=$PROJECT --zone=$ZONE" >&2
}

stop() {  # stop CODE MESSAGE: no final checkpoint will come, so the verifier is stopped too
  echo "$2" >&2
  if [ -n "$verifier_pid" ]; then
    # SIGTERM ends --follow cleanly: verdicts already written stay, nothing half-written.
    gc "${ssh_vm[@]}" --command="$verifier_stop" || echo "could not stop the verifier on $VERIFIER_VM" >&2
    wait "$verifier_pid" || true
  fi
  cleanup_hint
  exit "$1"
}

verifier_pid=
start_verifier || stop "$EXIT_FAILURE" "could not start the verifier on $VERIFIER_VM"
restarts=0
while :; do
  ensure_tpu || stop "$EXIT_FAILURE" "could not create TPU $TPU_NAME"
  code="$EXIT_OK"
  if retry "installing the workers" gc "${ssh_workers[@]}" --command="$worker_install"; then
    gc "${ssh_workers[@]}" --command="$trainer" || code=$?  # one process per worker, all at once
  else
    code="$EXIT_FAILURE"
  fi
  if [ "$code" -eq "$EXIT_OK" ]; then break; fi
  if [ "$code" -ne "$EXIT_PREEMPTED" ] && is_one_of "$(tpu_state)" "$up_states"; then
    stop "$code" "trainer exited $code with the TPU up: not restarting ($EXIT_BAD_INPUT: bad input, \
$EXIT_FAILURE: failure)"
  fi
  restarts=$((restarts + 1))
  if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
    stop "$EXIT_PREEMPTED" "preempted again after $MAX_RESTARTS restarts: giving up; rerun this script to go on"
  fi
  echo "trainer exited $code (preempted): restart $restarts of $MAX_RESTARTS, from the latest committed" \
    "checkpoint" >&2
done
echo "trainer done; waiting for the verifier on $VERIFIER_VM to verify the final checkpoint" >&2
code="$EXIT_OK"
wait "$verifier_pid" || code=$?
echo "verifier exited $code ($EXIT_OK: every committed checkpoint passed, $EXIT_FAILURE: a verdict failed)" >&2
cleanup_hint
exit "$code"
