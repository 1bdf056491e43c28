"""The lease tests' tools: lease records written by hand in the documented JSON format (a foreign
holder "on another host" needs no second machine), the workdir's bytes, and contenders."""

import json
import os
import threading
import time

from checkpointing._src import lease as lease_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from checkpointing._src.workdir import step_dir as step_path


def files(root: str) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes); {} if it does not exist."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def committed_files(workdir: str) -> dict[str, bytes]:
    """The files of every committed step, keyed by '<step>/<path>'."""
    return {f"{step}/{name}": data for step in committed_steps(workdir)
            for name, data in files(str(step_path(workdir, step))).items()}


def unchanged(before: dict[str, bytes], after: dict[str, bytes]) -> bool:
    """Every file of `before` is still in `after` with the same bytes."""
    return all(after.get(name) == data for name, data in before.items())


def write_record(workdir: str, generation: int, *, host: str, pid: int = 4242, job_id=None,
                 expires_in: float = 600.0, pid_namespace=None) -> dict:
    """A lease record written by hand, as a holder on `host` would have written it."""
    now = time.time()
    record = {"host": host, "pid": pid, "job_id": job_id, "token": f"hand-{generation}", "lease_secs": 600.0,
              "started_at": now - 60, "renewed_at": now, "expires_at": now + expires_in, "released_at": None,
              "pid_namespace": pid_namespace}
    os.makedirs(workdir_lib.lease_dir(workdir), exist_ok=True)
    with open(os.path.join(workdir_lib.lease_dir(workdir), f"{generation}.json"), "w") as f:
        json.dump(record, f)
    return record


def wait_for(condition, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def contend(workdir: str, after_generation: int, contenders: int = 8) -> list:
    """`contenders` threads claim generation after_generation + 1 at the same moment; the winners."""
    barrier = threading.Barrier(contenders)
    won = []

    def contender(index: int) -> None:
        identity = lease_lib.Identity(f"node-{index}", 1000 + index, None)
        barrier.wait()
        lease = lease_lib.claim(workdir, after_generation, 60, identity=identity)
        if lease is not None:
            won.append(lease)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return won


def lease_files(workdir: str) -> dict[str, tuple[bytes, int]]:
    where = workdir_lib.lease_dir(workdir)
    return {name: (open(os.path.join(where, name), "rb").read(), os.stat(os.path.join(where, name)).st_mtime_ns)
            for name in os.listdir(where)}
