"""Durable writes on local disks: what is reported written survives a power loss.

A rename makes a file appear whole or not at all, but neither the file's bytes nor the rename
itself are on the disk until they are fsynced. So every write that something else trusts (a
committed step, a verdict, a lease record) follows one order:

  1. fsync the file (for a step: every file under the step's tmp directory, and each directory);
  2. rename it into place;
  3. fsync the parent directory, which makes the rename durable.

Only after step 3 is the write reported (logged, listed by this process, counted, exit 75).

Object stores (gs://, s3://) have no directories and no rename: an object is durable once its upload
returns (GCS and S3 acknowledge a write only after it is stored redundantly), and it appears whole or
not at all. Orbax commits a step there by writing its commit marker last, so nothing here applies there.
"""

import os
import uuid

from checkpointing._src import object_store


def is_local(path) -> bool:
    return not object_store.is_object_store(path)


def sync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path) -> None:
    """fsyncs a directory: its entries (a created, renamed or removed name) reach the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path) -> None:
    """Creates `path` and its missing parents, each made durable by fsyncing its parent once it exists (a
    file later fsynced inside a directory whose own entry was lost is lost with it). Object stores: no directories."""
    if not is_local(path):
        return
    path, missing = os.path.abspath(str(path)), []
    while not os.path.isdir(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:  # another process made it first: its entry still needs the fsync
            pass
        sync_dir(os.path.dirname(directory))


def sync_tree(root) -> None:
    """fsyncs every file under `root`, then each directory, deepest first, `root` last."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                sync_file(path)
        sync_dir(directory)


def write_text(path, text: str) -> None:
    """Writes `path` so that readers see the old file or the whole new one, durably: a tmp file in
    the same directory, fsynced, renamed over `path`, then the directory fsynced. A failed write
    (a full disk) removes its tmp file."""
    path = str(path)
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    sync_dir(directory)
