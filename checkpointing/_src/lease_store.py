"""Where the workdir lease's records live: a local directory, a gs:// or an s3:// prefix (see lease.py).

Both stores hold numbered records `<generation>.json` and offer the same five operations; the
one that matters is `create`, which never replaces an existing record:
  - local disks: the record is written to a private tmp file, fsynced and hard-linked to its name,
    then the directory is fsynced (checkpointing/_src/durable.py). link(2) fails if the name exists (the
    O_CREAT|O_EXCL guarantee, NFS included), and the record appears whole, never half-written;
  - gs://: the object is uploaded with if_generation_match=0, which GCS refuses if it exists; a
    rewrite names the object generation it read (google-cloud-storage honours
    STORAGE_EMULATOR_HOST, so tests run against an emulator);
  - s3://: the object is put with `If-None-Match: *`, which S3 refuses (412) if it exists; a rewrite
    names the ETag it read (`If-Match`). botocore, configured as boto3 is (object_store.py), retries
    throttling (503 SlowDown) and dropped connections; a retried create refused after its first try
    succeeded is read back by the caller (lease.claim), as on gs://. An S3-compatible store that ignores
    the condition would let two writers in: a store's first create is put twice, and a second put that
    is not refused is ConditionsIgnored, before anything is saved.
"""

import os
import re
import secrets

from checkpointing._src import durable, object_store

RECORD_NAME = re.compile(r"(\d+)\.json")
GCS_TIMEOUT_SECS = 10.0  # per request; transient errors are retried for at most 3x this in all
S3_TIMEOUT_SECS = 10.0  # per request (connect and read); botocore's standard retries: at most 5 attempts


class Conflict(Exception):
    """A precondition failed: someone else wrote the object since we read it."""


class ConditionsIgnored(OSError):
    """The object store accepted a conditional write it had to refuse: it cannot keep one writer per workdir."""


def open_store(where: str):
    """The store of the records under `where` (a local directory, gs://bucket/prefix or s3://bucket/prefix)."""
    store = object_store.store_of(where)
    return GcsStore(where) if store == object_store.GCS else S3Store(where) if store == object_store.S3 \
        else LocalStore(where)


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when the storage fails (a full disk, an unreachable bucket)."""
    errors: tuple[type[BaseException], ...] = (OSError,)
    try:
        from google.api_core.exceptions import GoogleAPIError
        from google.auth.exceptions import GoogleAuthError

        errors += (GoogleAPIError, GoogleAuthError)
    except ImportError:  # only gs:// needs them
        pass
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += (BotoCoreError, ClientError)
    except ImportError:  # only s3:// needs them
        pass
    return errors


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


class S3Store:
    def __init__(self, where: str):
        import botocore.config
        import botocore.session

        self.where = where.rstrip("/")
        self._bucket, prefix = object_store.split(where)
        self._prefix = prefix + "/" if prefix else ""
        config = botocore.config.Config(connect_timeout=S3_TIMEOUT_SECS, read_timeout=S3_TIMEOUT_SECS,
                                        retries={"mode": "standard", "max_attempts": 5})
        self._client = botocore.session.get_session().create_client(
            "s3", region_name=object_store.s3_settings().region, config=config)
        self._conditions_checked = False

    def generations(self) -> list[int]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=self._prefix)
        return _generations(item["Key"][len(self._prefix):] for page in pages for item in page.get("Contents", ()))

    def read(self, generation: int):
        """(text, ETag) or None if that generation does not exist."""
        try:
            answer = self._client.get_object(Bucket=self._bucket, Key=self._key(generation))
        except self._client.exceptions.NoSuchKey:
            return None
        return answer["Body"].read().decode(), answer["ETag"]

    def create(self, generation: int, text: str) -> None:
        self._put(generation, text, IfNoneMatch="*")
        if not self._conditions_checked:  # once per store: the same bytes again, which S3 must refuse
            self._conditions_checked = True
            try:
                self._put(generation, text, IfNoneMatch="*")
            except Conflict:
                return
            raise ConditionsIgnored(f"{self.where}: the store accepted a second 'If-None-Match: *' write of "
                                    f"{self._key(generation)}; without conditional writes two writers could "
                                    "share this workdir (AWS S3 has them; check your S3-compatible store)")

    def replace(self, generation: int, text: str, version) -> str:
        return self._put(generation, text, IfMatch=version)

    def remove(self, generation: int) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._key(generation))  # absent: S3 answers 204

    def _key(self, generation: int) -> str:
        return f"{self._prefix}{generation}.json"

    def _put(self, generation: int, text: str, **condition) -> str:
        """Puts under the condition; Conflict if S3 refuses it (412, or 409 for a racing conditional write)."""
        from botocore.exceptions import ClientError

        try:
            answer = self._client.put_object(Bucket=self._bucket, Key=self._key(generation), Body=text.encode(),
                                             ContentType="application/json", **condition)
        except ClientError as err:
            if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                raise Conflict() from None
            raise
        return answer["ETag"]
