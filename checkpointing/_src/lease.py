"""One writer per workdir: a lease that names its holder and is renewed while the holder runs.

Layout: <workdir>/lease/<generation>.json, outside <workdir>/checkpoints (Orbax owns that
directory alone, and on an object store deletes anything in it without a commit marker). The newest
generation is the lease; the one before it stays as history, older ones are pruned. Taking the
lease, fresh or over an expired holder, creates generation g+1 exclusively (a hard link on local
disks, if_generation_match=0 on gs://, If-None-Match on s3://: lease_store.py), so of two contenders that judged the
same generation g exactly one wins; the winner reads its record back and checks that nothing
newer exists, so a claim can never land below a newer generation either.
The holder rewrites its own generation every lease_secs/4 (tmp + os.replace; on gs:// with its
object generation as the precondition, on s3:// its ETag). `check()`, called before each save, reads the newest
generation again: once it is not ours (a holder that stalled past its expiry was taken over),
it raises LeaseLostError and the holder must stop writing.

Rules at acquire, judging the newest record R:
  1. no R, or R released, or R expired: take it;
  2. R held on this host (same boot, same pid namespace) by a pid that is gone: take it at once
     (one log line);
  3. R held by our job id (a scheduler restarted this job while its old process still dies):
     wait until R expires (at most R's lease_secs), taking it as soon as rule 1 or 2 holds; if
     R was renewed meanwhile, its holder is alive: refuse;
  4. otherwise refuse at once with WorkdirLeasedError naming the holder.
The job id is $SLURM_JOB_ID, else $JOB_ID (a name that survives the job's restarts: the GKE
JobSet sets its own), else none. Expiry compares wall clocks, so hosts must agree to well within
lease_secs (NTP does). Readers (the verifier, inspect) never take or touch the lease.
"""

import dataclasses
import json
import secrets
import threading
import time

from absl import logging

from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import LeaseLostError, StorageUnavailableError, WorkdirLeasedError, one_line_cause
from checkpointing._src.lease_identity import JOB_ID_VARS, Identity, dead_here  # noqa: F401  (JOB_ID_VARS: tests)
from checkpointing._src.lease_store import Conflict, open_store, storage_errors

@dataclasses.dataclass(frozen=True)
class Record:
    """One generation of the lease (JSON); times are seconds since the epoch."""

    host: str
    pid: int
    job_id: str | None
    token: str  # random: tells two holders with the same host and pid apart
    lease_secs: float
    started_at: float
    renewed_at: float
    expires_at: float
    released_at: float | None = None
    pid_namespace: str | None = None

    def free(self, now: float) -> bool:
        return self.released_at is not None or now >= self.expires_at

    def describe(self, now: float) -> str:
        return (f"host {self.host} pid {self.pid} job {self.job_id or 'none'} since {_utc(self.started_at)}, "
                f"expires in {max(self.expires_at - now, 0.0):.0f} s")

    def to_text(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


_RECORD_FIELDS = tuple(field.name for field in dataclasses.fields(Record))  # newer writers may add more


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _store(workdir: str):
    return open_store(workdir_lib.lease_dir(workdir))


def _read(store, generation: int):
    """(record, version) of a generation, None if it is gone; WorkdirLeasedError if unreadable."""
    found = store.read(generation)
    if found is None:
        return None
    text, version = found
    try:
        fields = json.loads(text)
        return Record(**{name: fields[name] for name in _RECORD_FIELDS if name in fields}), version
    except (ValueError, TypeError, AttributeError) as err:
        raise WorkdirLeasedError(f"the lease record {store.where}/{generation}.json is unreadable ({err}); "
                                 "remove it once no writer uses this workdir") from None


def _newest(store):
    """(generation, record, version) of the newest generation, or None."""
    for generation in reversed(store.generations()):
        found = _read(store, generation)
        if found is not None:  # else it was pruned between the listing and the read
            return generation, *found
    return None


def holder(workdir: str) -> Record | None:
    """The newest lease record of `workdir` (read only), or None."""
    newest = _newest(_store(workdir))
    return newest[1] if newest else None


def free_to_take(workdir: str, *, clock=time.time) -> bool:
    """Whether nobody holds `workdir` (no record, released, expired, or its holder's pid on this host is gone):
    then what a killed save left in checkpoints/ is nobody's, and may go before the lease is taken."""
    newest = _newest(_store(workdir))
    return newest is None or newest[1].free(clock()) or dead_here(newest[1], Identity.of_this_process())


class Lease:
    """A held lease: renewed in the background until release(); call check() before each write."""

    def __init__(self, store, generation: int, record: Record, version, *, clock=time.time):
        self.generation = generation
        self._store, self._record, self._version, self._clock = store, record, version, clock
        self._lock = threading.Lock()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_every_quarter, name="workdir-lease", daemon=True)
        self._thread.start()

    @property
    def record(self) -> Record:
        return self._record

    def check(self) -> None:
        """LeaseLostError unless the newest generation is still ours, read now: a save must never
        race a writer that took over, even one the background renewal has not noticed yet."""
        with self._lock:
            if self._lost is None and not self._stop.is_set():
                expired = self._clock() >= self._record.expires_at
                try:
                    self._confirm(extend=expired)  # renewals stalled (a stopped process): extend now
                except Exception as err:
                    if expired:  # nobody can tell whether it was taken over
                        self._lost = f"the lease on {self._store.where} expired and could not be renewed ({err})"
                    else:
                        logging.warning("workdir lease: cannot read %s (%s); still ours until %s",
                                        self._store.where, err, _utc(self._record.expires_at))
        if self._lost is not None:
            raise LeaseLostError(self._lost + "; this writer must stop")

    def renew(self) -> None:
        """Extends the lease, or marks it lost if a newer generation exists."""
        with self._lock:
            if self._lost is None and not self._stop.is_set():
                self._confirm(extend=True)

    def _confirm(self, *, extend: bool) -> None:
        newest = _newest(self._store)
        if newest is None or newest[0] != self.generation or newest[1].token != self._record.token:
            self._mark_lost(newest)
            return
        if not extend:
            return
        now = self._clock()
        record = dataclasses.replace(self._record, renewed_at=now, expires_at=now + self._record.lease_secs)
        try:
            self._version = self._store.replace(self.generation, record.to_text(), self._version)
        except Conflict:
            self._mark_lost(_newest(self._store))
            return
        self._record = record

    def release(self) -> None:
        """Marks our generation released (if it is still ours) so the next writer starts at once."""
        self._stop.set()
        with self._lock:
            if self._lost is not None:
                return
            try:
                newest = _newest(self._store)
                if newest is not None and newest[0] == self.generation and newest[1].token == self._record.token:
                    now = self._clock()
                    released = dataclasses.replace(self._record, released_at=now, expires_at=now)
                    self._store.replace(self.generation, released.to_text(), newest[2])
                    self._record = released
            except Exception as err:  # the lease then simply expires
                logging.warning("workdir lease: could not release %s/%d.json (%s); it expires at %s",
                                self._store.where, self.generation, err, _utc(self._record.expires_at))

    def _mark_lost(self, newest) -> None:
        now = self._clock()
        taker = f"generation {newest[0]} now names {newest[1].describe(now)}" if newest else "its record is gone"
        self._lost = f"lost the lease on {self._store.where} (held as generation {self.generation}): {taker}"
        logging.error("workdir lease: %s", self._lost)

    def _renew_every_quarter(self) -> None:
        while not self._stop.wait(self._record.lease_secs / 4):
            try:
                self.renew()
            except Exception as err:  # a storage hiccup; check() refuses writes once the lease expires
                logging.warning("workdir lease: renewal of %s failed (%s); retrying", self._store.where, err)
            if self._lost is not None:
                return


def claim(workdir: str, after_generation: int, lease_secs: float, *, identity: Identity | None = None,
          clock=time.time) -> Lease | None:
    """Creates generation `after_generation + 1` naming us; None if another contender created it first."""
    store, identity = _store(workdir), identity or Identity.of_this_process()
    generation, now = after_generation + 1, clock()
    record = Record(host=identity.host, pid=identity.pid, job_id=identity.job_id, token=secrets.token_hex(16),
                    lease_secs=lease_secs, started_at=now, renewed_at=now, expires_at=now + lease_secs,
                    pid_namespace=identity.pid_namespace)
    try:
        store.create(generation, record.to_text())
    except Conflict:
        pass  # on an object store a retried create can be refused after its first try succeeded: read back
    found = _read(store, generation)
    if found is None or found[0].token != record.token:
        return None
    if max(store.generations(), default=generation) != generation:  # a stale claim below a newer one
        store.remove(generation)
        return None
    for old in store.generations():
        if old < generation - 1:
            store.remove(old)
    return Lease(store, generation, record, found[1], clock=clock)


def acquire(workdir: str, lease_secs: float, *, identity: Identity | None = None, clock=time.time,
            sleep=time.sleep) -> Lease:
    """Takes the workdir's lease per the rules above, or raises WorkdirLeasedError naming the holder.

    StorageUnavailableError if the lease cannot be read or written (a full disk, an unreachable bucket).
    """
    try:
        return _acquire(workdir, lease_secs, identity or Identity.of_this_process(), clock, sleep)
    except storage_errors() as err:
        raise StorageUnavailableError(
            f"cannot take the lease in {workdir_lib.lease_dir(workdir)}: {one_line_cause(err)}") from err


def _acquire(workdir: str, lease_secs: float, identity: Identity, clock, sleep) -> Lease:
    store = _store(workdir)
    deadline = None
    while True:
        newest, now = _newest(store), clock()
        if newest is None or newest[1].free(now) or dead_here(newest[1], identity):
            if newest is not None and not newest[1].free(now):
                logging.warning("workdir lease: pid %d on this host held %s and is gone; taking it over",
                                newest[1].pid, store.where)
            lease = claim(workdir, newest[0] if newest else 0, lease_secs, identity=identity, clock=clock)
            if lease is not None:
                return lease
            continue  # another contender took that generation: judge the new holder
        record = newest[1]
        refusal = f"{workdir} is leased to another writer ({record.describe(now)})"
        if identity.job_id is None or record.job_id != identity.job_id:
            raise WorkdirLeasedError(refusal)
        if deadline is None:
            deadline = record.expires_at
            logging.warning("workdir lease: held by an earlier process of job %s (%s); waiting for it to expire",
                            record.job_id, record.describe(now))
        elif now >= deadline:
            raise WorkdirLeasedError(f"{refusal}; it was renewed while this job waited for it to expire")
        sleep(min(max(deadline - now, 0.0) + 0.05, 1.0))
