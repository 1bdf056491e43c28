"""A local pod: N processes x M CPU devices on 127.0.0.1 with the real JAX distributed runtime.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- --workdir=DIR --mesh=data=4,model=2

Each process runs `python -m <module>` (default trainer.train) with the given flags plus
--coordinator_address/--num_processes/--process_id, and --xla_force_host_platform_device_count
set to M; collectives between processes go over gloo. The launcher prefixes every output line
with the process id, forwards SIGTERM/SIGINT to every process (a pod-wide preemption), and once
one process has exited gives the others --peer_exit_grace_secs to follow before killing them, so
no process outlives the pod. Its exit code is the pod's: 0 if every process succeeded; 75
(requeue) if every process exited 0 or 75, or a process was lost (SIGKILL from outside the pod;
the runtime then aborts the others); 2 if any exited 2; else 1 (rules: launch/pod.py).
"""

import sys

from absl import flags

from runtime import entry, logs
from launch.pod import run_pod

NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes in the pod.", lower_bound=1)
DEVICES_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 4, "Fake CPU devices per process.", lower_bound=1)
MODULE = flags.DEFINE_string("module", "trainer.train", "Python module each process runs.")
PEER_EXIT_GRACE_SECS = flags.DEFINE_float(
    "peer_exit_grace_secs", 30.0, "After one process exits, how long the others may take before being killed.")


def main(argv: list[str]) -> None:
    logs.quiet_library_logs()
    sys.exit(run_pod(MODULE.value, argv[1:], NUM_PROCESSES.value, DEVICES_PER_PROCESS.value,
                     PEER_EXIT_GRACE_SECS.value))


if __name__ == "__main__":
    entry.run(main, takes_arguments=True)
