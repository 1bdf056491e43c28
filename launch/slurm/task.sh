#!/usr/bin/env bash
# One Slurm task: `python -m MODULE FLAGS...` as process $SLURM_PROCID of the step's tasks.
#
#   srun ... bash launch/slurm/task.sh trainer.train --workdir=DIR ...     (train.sbatch, verify.sbatch)
#
# Environment (exported by the batch script through srun):
#   CKPT_PYTHON                 the interpreter (required)
#   CKPT_REPO                   the repository root, put on PYTHONPATH (required)
#   CKPT_COORDINATOR_ADDRESS    host:port of process 0's coordinator (required with more than one task)
#   CKPT_CPU_DEVICES_PER_TASK   local testing only: JAX_PLATFORMS=cpu and this many fake CPU devices
#
# With more than one task the module gets --coordinator_address/--num_processes/--process_id, so
# runtime/distributed.py takes its explicit path (the one the local pod launcher uses).
#
# Signals: Slurm signals every process of the step (slurmstepd's process tracking), so Python
# gets SIGTERM straight from slurmstepd; this shell only has to survive it (`trap :`: bash runs
# the trap after its foreground child exits) so that it can rank the exit code below.
#
# Exit code: srun returns the HIGHEST exit code of its tasks, but the local pod launcher's rule
# (pod_exit_code) is "75 only if every process exited 0 or 75; 2 if any exited 2;
# else 1". Ranking the codes so that the highest one is the pod's code makes srun compute that
# rule: 0 -> 0, 75 -> 75, 2 -> 202 (bad input), anything else -> 201 (failure). A task killed
# before this shell could rank it shows up as 128+signal (a failure too). The batch scripts map
# 201/202 back to 1/2.
set -uo pipefail

module="${1:?usage: task.sh MODULE [FLAGS...]}"
shift
: "${CKPT_PYTHON:?CKPT_PYTHON is not set}"
: "${CKPT_REPO:?CKPT_REPO is not set}"
num_processes="${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-1}}"
process_id="${SLURM_PROCID:-0}"

export PYTHONPATH="$CKPT_REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "${CKPT_CPU_DEVICES_PER_TASK:-}" ]; then
  xla_flags=""
  for flag in ${XLA_FLAGS:-}; do
    case "$flag" in
      --xla_force_host_platform_device_count=*) ;;
      *) xla_flags="$xla_flags $flag" ;;
    esac
  done
  xla_flags="$xla_flags --xla_force_host_platform_device_count=$CKPT_CPU_DEVICES_PER_TASK"
  export XLA_FLAGS="${xla_flags# }"
  export JAX_PLATFORMS=cpu
fi

distributed=()
if [ "$num_processes" -gt 1 ]; then
  : "${CKPT_COORDINATOR_ADDRESS:?CKPT_COORDINATOR_ADDRESS is not set (the batch script sets it)}"
  distributed=(--coordinator_address="$CKPT_COORDINATOR_ADDRESS" --num_processes="$num_processes"
               --process_id="$process_id")
fi

trap : TERM INT HUP USR1 USR2
"$CKPT_PYTHON" -m "$module" "$@" ${distributed[@]+"${distributed[@]}"}
code=$?
echo "task.sh: process $process_id of $num_processes on $(hostname -s): $module exited $code" >&2
case "$code" in
  0) exit 0 ;;
  75) exit 75 ;;
  2) exit 202 ;;
  *) exit 201 ;;
esac
