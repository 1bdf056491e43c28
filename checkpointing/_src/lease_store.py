"""Where the workdir lease's records live: a local directory or a gs:// prefix (see lease.py).

Both stores hold numbered records `<generation>.json` and offer the same five operations; the
one that matters is `create`, which never replaces an existing record:
  - local disks: the record is written to a private tmp file, fsynced and hard-linked to its name,
    then the directory is fsynced (checkpointing/_src/durable.py). link(2) fails if the name exists (the
    O_CREAT|O_EXCL guarantee, NFS included), and the record appears whole, never half-written;
  - gs://: the object is uploaded with if_generation_match=0, which GCS refuses if it exists; a
    rewrite names the object generation it read (google-cloud-storage honours
    STORAGE_EMULATOR_HOST, so tests run against an emulator).
"""

import os
import re
import secrets

from checkpointing._src import durable

RECORD_NAME = re.compile(r"(\d+)\.json")
GCS_TIMEOUT_SECS = 10.0  # per request; transient errors are retried for at most 3x this in all


class Conflict(Exception):
    """A precondition failed: someone else wrote the object since we read it."""


def open_store(where: str):
    """The store of the records under `where` (a local directory or gs://bucket/prefix)."""
    return GcsStore(where) if where.startswith("gs://") else LocalStore(where)


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when the storage fails (a full disk, an unreachable bucket)."""
    try:
        from google.api_core.exceptions import GoogleAPIError
        from google.auth.exceptions import GoogleAuthError
    except ImportError:  # only gs:// needs them
        return (OSError,)
    return OSError, GoogleAPIError, GoogleAuthError


def _generations(names) -> list[int]:
    return sorted(int(match.group(1)) for match in map(RECORD_NAME.fullmatch, names) if match)


class LocalStore:
    def __init__(self, where: str):
        self.where = where

    def generations(self) -> list[int]:
        try:
            return _generations(os.listdir(self.where))
        except FileNotFoundError:
            return []

    def read(self, generation: int):
        """(text, version) or None if that generation does not exist."""
        try:
            with open(self._path(generation)) as f:
                return f.read(), None
        except FileNotFoundError:
            return None

    def create(self, generation: int, text: str) -> None:
        """Creates the record unless the name exists (then the other's record stays)."""
        durable.make_dirs(self.where)
        tmp = self._write_tmp(generation, text)
        try:
            os.link(tmp, self._path(generation))
        except FileExistsError:
            pass
        finally:
            _unlink(tmp)
        durable.sync_dir(self.where)  # the link (and the tmp file's removal) reach the disk

    def replace(self, generation: int, text: str, version) -> None:
        tmp = self._write_tmp(generation, text)
        try:
            os.replace(tmp, self._path(generation))
        except BaseException:
            _unlink(tmp)
            raise
        durable.sync_dir(self.where)

    def remove(self, generation: int) -> None:
        _unlink(self._path(generation))
        durable.sync_dir(self.where)

    def _path(self, generation: int) -> str:
        return os.path.join(self.where, f"{generation}.json")

    def _write_tmp(self, generation: int, text: str) -> str:
        tmp = os.path.join(self.where, f".{generation}.json.tmp-{secrets.token_hex(8)}")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk leaves no empty tmp file behind
            _unlink(tmp)
            raise
        return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class GcsStore:
    def __init__(self, where: str):
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        bucket, _, prefix = where[len("gs://"):].partition("/")
        self.where = where.rstrip("/")
        self._calls = {"timeout": GCS_TIMEOUT_SECS, "retry": DEFAULT_RETRY.with_timeout(3 * GCS_TIMEOUT_SECS)}
        self._client = storage.Client()
        self._bucket = self._client.bucket(bucket)
        self._prefix = prefix.strip("/") + "/"

    def generations(self) -> list[int]:
        blobs = self._client.list_blobs(self._bucket, prefix=self._prefix, **self._calls)
        return _generations(blob.name[len(self._prefix):] for blob in blobs)

    def read(self, generation: int):
        """(text, object generation) or None if that generation does not exist."""
        from google.api_core import exceptions

        blob = self._blob(generation)
        try:
            return blob.download_as_text(**self._calls), blob.generation
        except exceptions.NotFound:
            return None

    def create(self, generation: int, text: str) -> None:
        self._upload(generation, text, 0)

    def replace(self, generation: int, text: str, version) -> int:
        return self._upload(generation, text, version)

    def remove(self, generation: int) -> None:
        from google.api_core import exceptions

        try:
            self._blob(generation).delete(**self._calls)
        except exceptions.NotFound:
            pass

    def _blob(self, generation: int):
        return self._bucket.blob(f"{self._prefix}{generation}.json")

    def _upload(self, generation: int, text: str, if_generation_match: int):
        """Uploads under the precondition (0: must not exist); Conflict if GCS refuses it."""
        from google.api_core import exceptions

        blob = self._blob(generation)
        try:
            blob.upload_from_string(text, content_type="application/json", if_generation_match=if_generation_match,
                                    **self._calls)
        except exceptions.PreconditionFailed:
            raise Conflict() from None
        return blob.generation
