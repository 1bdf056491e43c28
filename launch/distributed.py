"""Multi-controller start-up shared by the trainer and the verifier: one process per host.

Where the process count comes from, in order:
  --coordinator_address/--num_processes/--process_id   explicit (the local pod launcher uses these)
  Slurm (SLURM_JOB_ID with SLURM_NTASKS > 1)           jax.distributed.initialize() reads the job
  Cloud TPU pod (TPU_WORKER_HOSTNAMES lists > 1 host)  jax.distributed.initialize() with no arguments
  otherwise                                            a single process; nothing to initialize
After initialization JAX's preemption notifier owns SIGTERM: see launch/preemption.py.
"""

import os

import jax
from absl import flags, logging

COORDINATOR_ADDRESS = flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (one per host).", lower_bound=1)
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).", lower_bound=0)
HEARTBEAT_TIMEOUT_SECS = flags.DEFINE_integer(
    "heartbeat_timeout_secs", 30, "A peer silent this long is declared dead and the job stops.", lower_bound=5)


def _scheduler_runs_many_processes() -> str | None:
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu"
    return None


def initialize() -> None:
    """Starts the JAX distributed runtime if this is a multi-process job; call before any JAX work."""
    if COORDINATOR_ADDRESS.value:
        source = "flags"
        if NUM_PROCESSES.value is None or PROCESS_ID.value is None:
            raise ValueError("--coordinator_address needs --num_processes and --process_id")
        if PROCESS_ID.value >= NUM_PROCESSES.value:
            raise ValueError(f"--process_id={PROCESS_ID.value} must be below --num_processes={NUM_PROCESSES.value}")
        jax.distributed.initialize(coordinator_address=COORDINATOR_ADDRESS.value, num_processes=NUM_PROCESSES.value,
                                   process_id=PROCESS_ID.value,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECS.value)
    elif (source := _scheduler_runs_many_processes()) is not None:
        jax.distributed.initialize(heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECS.value)
    else:
        return
    logging.info("process %d of %d (from %s), %d local devices of %d", jax.process_index(), jax.process_count(),
                 source, jax.local_device_count(), jax.device_count())


def is_multiprocess() -> bool:
    return jax.process_count() > 1
