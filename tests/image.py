"""docker/Dockerfile built by podman and run from the image's own filesystem (tests/test_image.py).

Build: `podman build --isolation chroot` (the default OCI isolation cannot set rlimits in these
VMs) of the repository root with docker/Dockerfile, its ignore file and the CPU build argument,
as a user's `docker build` would; the base is tests/image_base.sh's stand-in, since no image
registry is reachable (--pull=never: the build never tries one).

Run: `podman run` does not work in these VMs (cgroups in hybrid mode), so a command runs the way
the image says to run it, from the image's own files: `podman image mount` gives its root
filesystem, the lower layer of an overlay whose upper layer is the run's own (a container's
writable layer); in a fresh mount and network namespace (`unshare --mount --net`: only a loopback
interface, and every mount vanishes with the process) /proc, /dev and a host directory on /tmp
are bound in, then `chroot` as the image's USER into its WORKDIR with exactly its ENV, and exec of
its ENTRYPOINT with the arguments. Each step of that chain execs the next, so the PID returned is
the entry point's, then the trainer's, as PID 1 is in a container: signals reach it and its exit
code is the command's.
"""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time

from tests import helpers

BASE = "localhost/python:3.11-slim-bookworm"  # docker/Dockerfile's FROM, as the stand-in is named
TAG = "localhost/ckpt-test:cpu"
TOOLS = ("podman", "debootstrap", "unshare", "chroot")
# This machine's way to the package index, lent to the build's RUN steps only (never stored in
# the image): its CA bundle (a proxy's CA among them, where there is one) and its pip settings.
NETWORK_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf")
# The build may not raise the open-file and process limits it inherits; these are what it needs.
ULIMITS = ("nofile=20000:20000", "nproc=32768:32768")
# podman's message when the kernel will not seal its re-executed binary (transient; see build()).
_SEAL_REFUSED = "sealing memfd copy: Device or resource busy"
BUILD_ATTEMPTS = 3
# Run in a fresh mount namespace (and network namespace) as root, then exec'd into the chroot:
# the image's files as the read-only lower layer of an overlay whose upper layer is this run's own
# (what a container engine gives each container), /proc and /dev bound in, and the test's
# directory on /tmp, the one path where what the run writes outlives it.
_CONTAINER = """set -e
lower="$1"; layer="$2"; tmp="$3"; shift 3
mkdir "$layer/upper" "$layer/work" "$layer/root"
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$layer/upper,workdir=$layer/work" "$layer/root"
mount --rbind /proc "$layer/root/proc"
mount --rbind /dev "$layer/root/dev"
mount --bind "$tmp" "$layer/root/tmp"
exec "$@"
"""


def missing() -> str | None:
    """Why the image cannot be built on this machine, or None."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install podman debootstrap; .ci/run does)"
    if os.geteuid() != 0:
        return "building and mounting the image needs root"
    return None


def build(log_path: str, tag: str = TAG, timeout: float = 900) -> float:
    """Builds docker/Dockerfile (CPU) as `tag` on the stand-in base; returns the seconds it took.
    Raises AssertionError with the log's tail if the base or the build fails."""
    with open(log_path, "w") as log:
        base = subprocess.run(["bash", "tests/image_base.sh", BASE], cwd=helpers.REPO_ROOT, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    assert base.returncode == 0, _tail(log_path)
    start = time.monotonic()
    for attempt in range(1, BUILD_ATTEMPTS + 1):
        with open(log_path, "a") as log:
            result = subprocess.run(
                ["podman", "build", "--isolation", "chroot", "--pull=never", *(f"--ulimit={u}" for u in ULIMITS),
                 *(f"--volume={path}:{path}:ro" for path in NETWORK_FILES if os.path.isfile(path)),
                 "-f", "docker/Dockerfile", "--ignorefile", "docker/Dockerfile.dockerignore",
                 "--build-arg", "JAX_EXTRA=cpu", "-t", tag, "."],
                cwd=helpers.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if result.returncode == 0 or _SEAL_REFUSED not in _tail(log_path):
            break
        # podman's own start-up, not the Dockerfile: the kernel may refuse (EBUSY) to seal the
        # in-memory copy of its binary that a RUN step re-executes. The layers built so far are
        # cached, so the next attempt resumes at that step.
        logging.warning("podman build attempt %d of %d: %s; building again", attempt, BUILD_ATTEMPTS, _SEAL_REFUSED)
    assert result.returncode == 0, f"podman build failed:\n{_tail(log_path)}"
    return time.monotonic() - start


def _tail(path: str, chars: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-chars:]


def inspect(tag: str = TAG) -> dict:
    """The image's record: "Config" (User, Env, Entrypoint, Cmd, WorkingDir) and "Size" in bytes."""
    result = subprocess.run(["podman", "image", "inspect", tag], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [record] = json.loads(result.stdout)
    return record


class Image:
    """A built image's root filesystem, mounted, and how to run a command from it."""

    def __init__(self, rootfs: str, config: dict, host_tmp: str, layers_dir: str):
        self.rootfs, self.config, self.host_tmp, self.layers_dir = rootfs, config, host_tmp, layers_dir

    def user_ids(self) -> tuple[int, int]:
        """(uid, gid) of the image's USER, from the image's own /etc/passwd."""
        user = self.config.get("User") or "root"
        with open(os.path.join(self.rootfs, "etc", "passwd")) as f:
            for line in f:
                fields = line.split(":")
                if user in (fields[0], fields[2]):
                    return int(fields[2]), int(fields[3])
        raise AssertionError(f"USER {user} is not in the image's /etc/passwd")

    def command(self, *args: str, **env: str) -> list[str]:
        """The argv that runs the image's entry point with `args`, `env` added to the image's ENV
        (as `docker run --rm -e K=V IMAGE ARGS` would), on a container layer of its own."""
        uid, gid = self.user_ids()
        layer = os.path.join(self.layers_dir, str(len(os.listdir(self.layers_dir))))
        os.makedirs(layer)
        environment = [*self.config.get("Env", []), f"HOME={self.home()}", *(f"{k}={v}" for k, v in env.items())]
        return ["unshare", "--mount", "--net", "sh", "-c", _CONTAINER, "container", self.rootfs, layer, self.host_tmp,
                "chroot", f"--userspec={uid}:{gid}", f"{layer}/root",
                "env", "-i", "-C", self.config.get("WorkingDir") or "/", *environment,
                *self.config["Entrypoint"], *(args or self.config.get("Cmd") or [])]

    def home(self) -> str:
        uid, _ = self.user_ids()
        with open(os.path.join(self.rootfs, "etc", "passwd")) as f:
            return next(line.split(":")[5] for line in f if line.split(":")[2] == str(uid))

    def run(self, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args, **env), capture_output=True, text=True, timeout=timeout)

    @contextlib.contextmanager
    def started(self, *args: str, log_path: str, **env: str):
        """Starts the command in its own session; killed by PID (SIGKILL) if still running on exit."""
        with open(log_path, "w") as log:
            proc = subprocess.Popen(self.command(*args, **env), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                yield proc
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)


@contextlib.contextmanager
def mounted(host_tmp: str, layers_dir: str, tag: str = TAG):
    """The image `tag` mounted read-only (`podman image mount`), unmounted on exit. Commands see
    `host_tmp` as /tmp; each one's container layer is a new directory under `layers_dir`."""
    result = subprocess.run(["podman", "image", "mount", tag], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    try:
        yield Image(result.stdout.strip(), inspect(tag)["Config"], host_tmp, layers_dir)
    finally:
        subprocess.run(["podman", "image", "unmount", tag], capture_output=True, timeout=120)
