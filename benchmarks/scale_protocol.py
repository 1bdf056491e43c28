"""The service's multi-host storage protocol run by many simulated processes (threads), counted.

Each simulated process is a long-lived thread with its own storage clients (gcsfs, s3fs and fsspec
keep one instance, and one listing cache, per thread; the lease store makes its own client), so it
makes the requests a host of a pod would. The pieces, and the code path each one follows:

  lease_acquire     process 0 opens the run: lease.acquire        (Checkpointer._acquire_pod_lease)
  lease_renewal     process 0, every lease_secs/4: Lease.renew
  lease_check       process 0 before each save: Lease.check       (Checkpointer._lease_check)
  lease_holder      a reader (the verifier, inspect): lease.holder
  save_check        every process at each save: the step must not be committed yet
                    (CheckpointService.save: fresh_path, the step's directory exists)
  listing           every process once a save ended: committed_steps   (CheckpointService.check_for_errors)
  manifest_read     every process at a restore: read_manifest of the newest step (restore.resume_candidates)
  verdict_listing   process 0's retention (Checkpointer._protected) and the verifier: current_steps

The other processes read nothing of the lease: process 0's answer reaches them by broadcast (one
collective at open, one per save). Orbax's own writes and reads of the arrays need a real JAX pod
and are measured by benchmarks/scale_pod_child.py.

Requests are counted by the GCS-protocol server (tests/gcs_emulator.py's request log) on gs://, the
S3 server (tests/s3_server.py's) on s3://, and by a Python audit hook on a local disk (file-system
calls Python audits: open, listdir, scandir, rename/replace, link, remove, mkdir; stat is not
audited, so exists() checks are missing).
"""

import collections
import dataclasses
import queue
import sys
import threading
import time

from checkpointing._src import lease as lease_lib
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib

AUDITED = frozenset({"open", "os.listdir", "os.scandir", "os.rename", "os.link", "os.remove", "os.mkdir"})
PIECES = {  # name -> who runs it: "primary" (process 0), "every" (each process), "reader" (one reader)
    "lease_acquire": "primary", "lease_renewal": "primary", "lease_check": "primary", "lease_holder": "reader",
    "save_check": "every", "listing": "every", "manifest_read": "every", "verdict_listing": "primary",
}


@dataclasses.dataclass(frozen=True)
class Measured:
    piece: str
    runs_on: str  # primary / every / reader
    callers: int  # simulated processes that ran it at once
    requests: int  # all callers together
    bytes: int  # request and response bodies (object stores only; 0 on a local disk)
    secs: float  # wall time of all callers together
    by_op: dict

    @property
    def per_caller(self) -> float:
        return self.requests / self.callers


class GcsRequests:
    """Counts from the GCS-protocol server's request log."""

    def __init__(self, url: str):
        from tests import gcs_emulator  # benchmarks may use the tests' server

        self._log = lambda clear: gcs_emulator.request_log(url, clear=clear)

    def start(self) -> None:
        self._log(True)

    def stop(self) -> tuple[int, int, dict]:
        log = self._log(True)
        moved = sum(r["bytes_in"] + r["bytes_out"] for r in log)
        return len(log), moved, dict(collections.Counter(r["op"] for r in log))


class S3Requests(GcsRequests):
    """Counts from the S3 server's request log (tests/s3_server.py: the same fields)."""

    def __init__(self, url: str):
        from tests import s3_server  # benchmarks may use the tests' server

        self._log = lambda clear: s3_server.request_log(url, clear=clear)


class AuditedCalls:
    """Counts the audited file-system calls made by the simulated processes' threads."""

    _installed = False
    _counting: "AuditedCalls | None" = None

    def __init__(self, threads: set[int]):
        self._threads, self._counts = threads, collections.Counter()
        if not AuditedCalls._installed:  # an audit hook cannot be removed: one for the process, off unless counting
            sys.addaudithook(AuditedCalls._hook)
            AuditedCalls._installed = True

    @staticmethod
    def _hook(event: str, args) -> None:
        counting = AuditedCalls._counting
        if counting is not None and event in AUDITED and threading.get_ident() in counting._threads:
            counting._counts[event] += 1

    def start(self) -> None:
        self._counts.clear()
        AuditedCalls._counting = self

    def stop(self) -> tuple[int, int, dict]:
        AuditedCalls._counting = None
        return sum(self._counts.values()), 0, dict(self._counts)


class SimulatedPod:
    """`hosts` long-lived threads, each one simulated process; run(fn, on) runs fn(index) on several at once."""

    def __init__(self, hosts: int, timeout_secs: float = 120):
        self.hosts, self._timeout = hosts, timeout_secs
        self._inboxes = [queue.Queue() for _ in range(hosts)]
        self._threads = [threading.Thread(target=self._serve, args=(inbox,), name=f"simulated-process-{i}",
                                          daemon=True) for i, inbox in enumerate(self._inboxes)]
        for thread in self._threads:
            thread.start()

    @property
    def thread_ids(self) -> set[int]:
        return {thread.ident for thread in self._threads}

    @staticmethod
    def _serve(inbox: queue.Queue) -> None:
        while (task := inbox.get()) is not None:
            task()

    def run(self, fn, on: range) -> float:
        """Wall seconds from the moment all of `on` start together until the last one ends; re-raises a failure."""
        start, done, errors = threading.Barrier(len(on) + 1), threading.Semaphore(0), []

        def task(index: int) -> None:
            try:
                start.wait(self._timeout)
                fn(index)
            except BaseException as err:  # handed to the caller below
                errors.append(err)
            finally:
                done.release()

        for index in on:
            self._inboxes[index].put(lambda index=index: task(index))
        start.wait(self._timeout)
        started = time.perf_counter()
        for _ in on:
            if not done.acquire(timeout=self._timeout):
                raise TimeoutError(f"a simulated process did not finish within {self._timeout:.0f}s")
        secs = time.perf_counter() - started
        if errors:
            raise errors[0]
        return secs

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for thread in self._threads:
            thread.join(self._timeout)


def simulate(workdir: str, hosts: int, counter_for, *, renewals: int = 3) -> list[Measured]:
    """Every piece of PIECES on a pod of `hosts` simulated processes over `workdir` (which holds
    committed steps: make_workdir). `counter_for(thread_ids)` gives a counter (GcsRequests, AuditedCalls)."""
    pod = SimulatedPod(hosts)
    counter, held, rows = counter_for(pod.thread_ids), {}, []
    steps = workdir_lib.committed_steps(workdir)
    newest = steps[-1]
    bodies = {
        "lease_acquire": lambda i: held.__setitem__("lease", lease_lib.acquire(workdir, 600.0)),
        "lease_renewal": lambda i: [held["lease"].renew() for _ in range(renewals)],
        "lease_check": lambda i: held["lease"].check(),
        "lease_holder": lambda i: lease_lib.holder(workdir),
        "save_check": lambda i: workdir_lib.fresh_path(workdir) and workdir_lib.step_dir(workdir, newest + 1).exists(),
        "listing": lambda i: workdir_lib.committed_steps(workdir),
        "manifest_read": lambda i: workdir_lib.read_manifest(workdir, newest),
        "verdict_listing": lambda i: verdicts.current_steps(workdir, steps),
    }
    try:
        for piece, runs_on in PIECES.items():
            on = range(hosts) if runs_on == "every" else range(hosts - 1, hosts) if runs_on == "reader" else range(1)
            counter.start()
            secs = pod.run(bodies[piece], on)
            requests, moved, by_op = counter.stop()
            if piece == "lease_renewal":  # per renewal
                requests, moved, secs = requests // renewals, moved // renewals, secs / renewals
                by_op = {op: count // renewals for op, count in by_op.items()}
            rows.append(Measured(piece, runs_on, len(on), requests, moved, secs, by_op))
    finally:
        if "lease" in held:
            held["lease"].release()
        pod.close()
    return rows


def make_workdir(workdir: str, steps: int, *, verified: int) -> None:
    """`steps` real committed steps of a small state (one process: real Orbax saves) and real verdicts
    on the first `verified` of them, as the verifier writes them (naming the manifest's digest)."""
    import jax.numpy as jnp

    from checkpointing._src.service import CheckpointService, RunMetadata
    from checkpointing.config import CheckpointConfig

    run = RunMetadata.of_run({"benchmark": "scale_sim"}, ["benchmark"], {"data": 1})
    service = CheckpointService(workdir, CheckpointConfig(max_to_keep=steps), run=run)
    for step in range(1, steps + 1):
        service.save(step * 10, {"w": jnp.full((64,), step, jnp.float32), "step": jnp.int32(step * 10)},
                     losses={step * 10 - 1: 1.0}, reason="interval")
        service.wait_until_finished()
    service.close()
    for step in workdir_lib.committed_steps(workdir)[:verified]:
        digest = workdir_lib.read_manifest(workdir, step)["digest"]
        verdicts.write(workdir, verdicts.make(
            step=step, level="reproduced", status="pass", detail="scale_sim", checkpoint_mesh={"data": 1},
            verifier_mesh={"data": 1}, durations_secs={}, manifest_digest=digest))
