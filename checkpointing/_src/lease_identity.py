"""Who asks for a workdir's lease (checkpointing/_src/lease.py), and whether a holder on this host is gone."""

import dataclasses
import os
import socket

JOB_ID_VARS = ("SLURM_JOB_ID", "JOB_ID")  # the first one set names this process's job


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who asks for the lease."""

    host: str
    pid: int
    job_id: str | None
    # Boot id and pid namespace: a pid is only meaningful where both match. Containers restarted
    # on one machine (a JobSet's pod keeps its hostname) see other pids than their predecessors.
    pid_namespace: str | None = None

    @classmethod
    def of_this_process(cls) -> "Identity":
        job_id = next((os.environ[name] for name in JOB_ID_VARS if os.environ.get(name)), None)
        return cls(socket.gethostname(), os.getpid(), job_id, _pid_namespace())


def _pid_namespace() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # not Linux: the dead-pid rule never applies
        return None


def _pid_gone(pid: int) -> bool:
    """Whether no process (or only a zombie) has this pid on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # killed, not yet reaped
    except (OSError, IndexError):
        return False


def dead_here(record, identity: Identity) -> bool:
    """Whether `record` (a lease record) is held on this host (same boot, same pid namespace) by a gone pid."""
    return (record.host == identity.host and record.pid_namespace is not None
            and record.pid_namespace == identity.pid_namespace and record.pid != identity.pid
            and _pid_gone(record.pid))
