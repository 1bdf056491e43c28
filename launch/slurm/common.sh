# shellcheck shell=bash
# Sourced by train.sbatch and verify.sbatch (Slurm runs a copy of the batch script from its spool
# directory, so they find this file through CKPT_REPO, not through their own path).
#
# Sets and exports CKPT_REPO, CKPT_PYTHON, CKPT_COORDINATOR_ADDRESS; defines ckpt_log,
# ckpt_srun and ckpt_job_field.

CKPT_REPO="${CKPT_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [ -z "${CKPT_PYTHON:-}" ]; then
  if [ -x "$CKPT_REPO/.venv/bin/python" ]; then CKPT_PYTHON="$CKPT_REPO/.venv/bin/python"; else CKPT_PYTHON=python3; fi
fi
export CKPT_REPO CKPT_PYTHON
CKPT_RESTART="${SLURM_RESTART_COUNT:-0}"

ckpt_log() {
  local now
  now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "[${CKPT_SCRIPT:-sbatch} job ${SLURM_JOB_ID:-?} restart $CKPT_RESTART $now] $*"
}

# One field of `scontrol show job -o` for this job (JobState, Restarts, ...); empty if unknown.
ckpt_job_field() {
  scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1
}

# The coordinator: process 0 runs on the first node of the allocation (srun's block distribution),
# reached at the address Slurm itself uses for that node (NodeAddr; the node name when none is
# configured), so a cluster whose node names do not resolve still works. The port is derived from
# the job id AND the restart count: a requeued instance never races the previous instance's
# socket, and two jobs sharing a node rarely collide (12000-27999, below Linux's ephemeral range).
# CKPT_COORDINATOR_HOST / CKPT_COORDINATOR_PORT override either part.
ckpt_coordinator_address() {
  local first addr port
  first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  addr="$(scontrol show node -o "$first" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)"
  port=$((12000 + (SLURM_JOB_ID % 1000) * 16 + CKPT_RESTART % 16))
  echo "${CKPT_COORDINATOR_HOST:-${addr:-$first}}:${CKPT_COORDINATOR_PORT:-$port}"
}

# ckpt_srun MODULE FLAGS...: runs task.sh on every task of the allocation and returns srun's
# (ranked, see task.sh) exit code. srun runs in the background and this shell waits for it: with a
# SIGTERM trap set, `wait` returns early on the signal and is simply called again, so the batch
# shell outlives a job-wide SIGTERM long enough to log what the tasks did.
# --kill-on-bad-exit=0: a process that exits first (say with 75) must not get its peers killed
# while they are still committing the same preemption checkpoint; a dead or stuck peer is bounded
# by the JAX heartbeat and the trainer's watchdog (--heartbeat_timeout_secs, --watchdog_secs).
ckpt_srun() {
  local pid
  srun --label --kill-on-bad-exit=0 bash "$CKPT_REPO/launch/slurm/task.sh" "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid"
  done
  wait "$pid"
}

# Maps a ranked srun code back to the trainer's exit codes (runtime/exit_codes.py).
ckpt_pod_code() {
  case "$1" in
    0) echo 0 ;;
    75) echo 75 ;;
    202) echo 2 ;;
    *) echo 1 ;;
  esac
}

export CKPT_COORDINATOR_ADDRESS="${CKPT_COORDINATOR_ADDRESS:-$(ckpt_coordinator_address)}"
