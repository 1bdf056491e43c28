"""A real single-node Slurm cluster (Debian's slurm-wlm 22.05 + munge) for tests, started as root.

Everything lives in one private directory under /tmp: a munge key, socket, pid, seed and log
(munged runs as the `munge` user on its own socket, so a system munged is never touched),
slurm.conf (tests/slurm_conf.py), slurmctld's state, slurmd's spool, both daemons' logs and pid
files. Free TCP ports are picked for slurmctld and slurmd, the node is addressed as 127.0.0.1 (no
name resolution needed), and every Slurm command gets SLURM_CONF pointing at the private slurm.conf. The three
daemons run in the foreground as children of the test process and are stopped by PID
(SIGTERM, then SIGKILL after a timeout).

    with SlurmCluster.started() as cluster:
        job = cluster.sbatch("launch/slurm/train.sbatch", "--workdir=...", options=["--ntasks=2"])
        cluster.wait_for_state(job, {"COMPLETED"}, timeout=300)
"""

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import psutil

from tests import slurm_conf

# Daemons and commands the cluster needs, and the Debian packages that provide them.
BINARIES = {
    "munged": "munge", "munge": "munge",
    "slurmctld": "slurmctld", "slurmd": "slurmd", "slurmstepd": "slurmd",
    "sbatch": "slurm-client", "scontrol": "slurm-client", "sinfo": "slurm-client", "scancel": "slurm-client",
    "srun": "slurm-client", "squeue": "slurm-client",
}
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                 "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


def why_unavailable() -> str | None:
    """None if a cluster can be started here, else the reason (for pytest.skip)."""
    missing = [name for name in BINARIES if shutil.which(name) is None
               and not os.path.exists(f"/usr/sbin/{name}")]
    if missing:
        packages = sorted({BINARIES[name] for name in missing})
        return (f"Slurm/munge binaries missing: {', '.join(missing)} "
                f"(install with: apt-get install -y {' '.join(packages)})")
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd runs jobs as their submitting user)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no `munge` user (Debian's munge package creates it)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """A private slurmctld + slurmd + munged; use `SlurmCluster.started()`."""

    def __init__(self, root: str, cpus: int | None = None):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(os.cpu_count() or 1, 4)
        self.munge_dir = os.path.join(root, "munge")  # 0755, owned by munge: the socket and pid
        self.munge_private = os.path.join(self.munge_dir, "private")  # 0700: key, seed, log
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket")
        self.conf = os.path.join(root, "slurm.conf")
        self.log_dir = os.path.join(root, "log")
        self.daemons: dict[str, subprocess.Popen] = {}
        self._logs = []
        self.leftovers: list[psutil.Process] = []

    # ---- commands -------------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del env[key]  # a test run inside a Slurm job must not leak that job's settings
        return env

    def run(self, *command: str, check: bool = True, timeout: float = 30,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(list(command), env=self.env(env), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *args: str, options: list[str] = (), env: dict[str, str] | None = None,
               cwd: str | None = None) -> int:
        """Submits `script args...` with sbatch `options`; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *options, script, *args], env=self.env(env), cwd=cwd,
                                capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise SlurmError(f"sbatch {script} exited {result.returncode}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, RestartCnt, ExitCode, Reason, BeginTime, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        fields = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_for_state(self, job_id: int, states: set[str], timeout: float, poll: float = 0.5) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} not in {sorted(states)} after {timeout:.0f}s: {fields}\n"
                                 + self.log_tail())
            time.sleep(poll)

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancels every job and waits until no job is left running or completing."""
        if "slurmctld" not in self.daemons or self.daemons["slurmctld"].poll() is not None:
            return
        self.run("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.run("squeue", "--noheader", "--states=all", "--format=%i %T", check=False).stdout.split("\n")
            if not [line for line in left if line.strip() and line.split()[-1] in ACTIVE_STATES]:
                return
            time.sleep(0.5)

    def leftover_processes(self) -> list[psutil.Process]:
        """Processes started for this cluster's jobs (slurmstepd, tasks): SLURM_CONF=this conf in
        their environment. Never the daemons themselves nor this process."""
        ours = {os.getpid(), *(p.pid for p in self.daemons.values())}
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid not in ours and proc.environ().get("SLURM_CONF") == self.conf:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.log_dir, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {path} (tail)\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)

    # ---- start and stop -------------------------------------------------------------------
    def _write_munge_files(self) -> None:
        munge = pwd.getpwnam("munge")
        os.makedirs(self.munge_private)
        with open(os.path.join(self.munge_private, "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(self.munge_private, "munge.key"), 0o400)
        for path in (self.munge_dir, self.munge_private, os.path.join(self.munge_private, "munge.key")):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o755)  # munged insists the socket's directory is searchable by all
        os.chmod(self.munge_private, 0o700)

    def _spawn(self, name: str, command: list[str], **kwargs) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.stdout"), "w")
        self._logs.append(log)
        self.daemons[name] = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)

    def _check_alive(self) -> None:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited {proc.returncode} at start-up\n{self.log_tail()}")

    def start(self, timeout: float = 60) -> None:
        self._write_munge_files()
        slurm_conf.write(self.root, self.node, self.cpus, self.munge_socket)
        p = self.munge_private
        self._spawn("munged", [_binary("munged"), "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={p}/munge.key", f"--log-file={p}/munged.log",
                               f"--pid-file={self.munge_dir}/munged.pid", f"--seed-file={p}/munged.seed"],
                    user="munge", group="munge", extra_groups=[])
        deadline = time.monotonic() + timeout
        while subprocess.run([_binary("munge"), "-n", "-S", self.munge_socket], capture_output=True).returncode:
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmError("munged did not answer on its socket")
            time.sleep(0.1)
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-f", self.conf])
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-f", self.conf, "-N", self.node])
        while True:
            self._check_alive()
            state = self.run("sinfo", "--noheader", "--node", self.node, "--format=%T", check=False)
            if state.returncode == 0 and state.stdout.strip().rstrip("*") == "idle":
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"node {self.node} not idle after {timeout:.0f}s: {state.stdout.strip()} "
                                 f"{state.stderr.strip()}\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        """Stops slurmd, slurmctld, then munged (by PID: SIGTERM, SIGKILL after `timeout`), then
        kills (by PID) any job process that outlived them (slurmstepd survives slurmd by design);
        those are kept in `self.leftovers`."""
        deadline = time.monotonic() + timeout  # job processes of cancelled jobs may still be exiting
        while self.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        self.leftovers = self.leftover_processes()
        for proc in self.leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(self.leftovers, timeout=timeout)
        for log in self._logs:
            log.close()
        self._logs = []

    @classmethod
    @contextlib.contextmanager
    def started(cls, keep: bool = False, **kwargs):
        """A started cluster in a fresh directory under /tmp (munge must be able to reach it);
        stopped, its jobs cancelled and the directory removed (unless `keep`) on exit."""
        root = tempfile.mkdtemp(prefix="slurm-cluster-", dir="/tmp")
        os.chmod(root, 0o755)
        cluster = cls(root, **kwargs)
        try:
            cluster.start()
            yield cluster
        finally:
            try:
                cluster.cancel_all()
            finally:
                cluster.stop()
                if not keep:
                    shutil.rmtree(root, ignore_errors=True)
