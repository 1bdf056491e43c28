"""slurm.conf for tests/slurm_cluster.py: a private single-node cluster whose every file lives under
its root directory, on free TCP ports, with the node addressed as 127.0.0.1 (no name resolution)."""

import os
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write(root: str, node: str, cpus: int, munge_socket: str) -> str:
    """Writes <root>/slurm.conf and the directories and empty plugstack.conf it names; returns its path."""
    path = os.path.join(root, "slurm.conf")
    for sub in ("state", "spool", "log", "run"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    plugstack = os.path.join(root, "plugstack.conf")
    open(plugstack, "w").close()
    r = root
    conf = f"""\
# Written by tests/slurm_cluster.py: a private single-node cluster.
ClusterName=ckpttest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/slurmd-%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={plugstack}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
SlurmdParameters=config_overrides
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    with open(path, "w") as f:
        f.write(conf)
    return path
