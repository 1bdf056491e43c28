"""The first contact with a workdir's storage, bounded, and what a reader needs of the workdir.

An unreachable gs:// or s3:// endpoint must be one line after --storage_timeout_secs, not minutes
of retries (gcsfs retries a refused connection six times, about 35 s, with a traceback each time;
botocore retries too; a stalled endpoint can take longer). So every entry point touches the workdir
first through `check_workdir`, in a thread it stops waiting for; refused credentials are one line
too. Readers (inspect, the verifier) also need the workdir to be there: a missing local directory or
a regular file is bad input; an existing empty one, or an object-store prefix with nothing under it,
is just a run with no checkpoints yet.
"""

import threading

from absl import flags

from checkpointing.config import resolve_path
from checkpointing.errors import StorageUnavailableError, one_line_cause
from checkpointing._src import object_store
from checkpointing._src.workdir import fresh_path

STORAGE_TIMEOUT_SECS = flags.DEFINE_float(
    "storage_timeout_secs", 30.0, "Longest the first access to the workdir's storage may take (an unreachable "
    "gs:// or s3:// endpoint) before the command exits 1.", lower_bound=0.1)


def check_workdir(workdir: str, *, must_exist: bool, timeout_secs: float | None = None,
                  flag: str = "--workdir") -> str:
    """The workdir resolved (config.resolve_path: absolute, or refused naming a character Orbax cannot
    round-trip). Raises ValueError if a reader's local workdir is missing or not a directory (bad input),
    and StorageUnavailableError if the storage does not answer within `timeout_secs` (default: the flag)."""
    workdir = resolve_path(workdir, flag)
    timeout_secs = STORAGE_TIMEOUT_SECS.value if timeout_secs is None else timeout_secs
    remote = object_store.is_object_store(workdir)
    where = f"endpoint {object_store.endpoint(workdir)}" if remote else "its file system"
    answer: dict = {}

    def probe() -> None:
        try:
            path = fresh_path(workdir)
            if remote:  # a listing: S3 names why it refuses one (a HEAD's 403 has no body to say it)
                answer["is_dir"] = path.is_dir()
            else:
                answer["exists"], answer["is_dir"] = path.exists(), path.is_dir()
        except Exception as err:  # gcsfs/s3fs out of retries, refused credentials, an I/O error: one line below
            answer["error"] = err

    thread = threading.Thread(target=probe, name="storage-probe", daemon=True)
    thread.start()
    thread.join(timeout_secs)
    if thread.is_alive():  # left behind, a daemon: the caller exits
        raise StorageUnavailableError(f"{flag}={workdir}: {where} unreachable (no answer within {timeout_secs:g}s)")
    if "error" in answer:
        raise StorageUnavailableError(f"{flag}={workdir}: {one_line_cause(answer['error'])}") from answer["error"]
    if remote:
        return workdir  # objects, not directories: an empty prefix is a workdir with nothing in it yet
    if answer["exists"] and not answer["is_dir"]:
        raise ValueError(f"{flag}={workdir} exists and is not a directory")
    if must_exist and not answer["exists"]:
        raise ValueError(f"{flag}={workdir} does not exist")
    return workdir
