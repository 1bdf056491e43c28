"""Which store a workdir path is on, and how to reach it: the one place that knows gs:// and s3://.

A path is a local one or an object-store URL. Object stores (GCS, S3 and S3-compatible servers such as
MinIO, Ceph, R2) have no directories and no rename: an object appears whole once its upload returns,
so a step commits by Orbax's commit marker written last (`commit_success.txt`), never by a rename.
Arrays go through TensorStore's own driver for the store (`gcs`, `s3`); directory operations through
fsspec (`gcsfs`, `s3fs`, which etils.epath uses) and the lease through the store's conditional writes.

S3 is configured as boto3 and the AWS CLI are: `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (a MinIO's
URL), `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` and
`AWS_PROFILE` with `~/.aws/config` and `~/.aws/credentials`. s3fs (botocore) reads them itself;
TensorStore's `s3` driver reads the credentials and the region but not the endpoint, so `s3_spec`
passes the endpoint and the region it resolved here explicitly.
"""

import dataclasses
import os

GCS, S3 = "gs", "s3"
_SCHEMES = {f"{GCS}://": GCS, f"{S3}://": S3}
DEFAULT_S3_REGION = "us-east-1"  # botocore's and TensorStore's default for a bucket with no region named


def store_of(path) -> str | None:
    """'gs' or 's3' for an object-store URL; None for a local path."""
    text = str(path)
    for prefix, name in _SCHEMES.items():
        if text.startswith(prefix):
            return name
    return None


def is_object_store(path) -> bool:
    """Whether `path` is on an object store (no directories, no rename, no fsync): gs:// or s3://."""
    return store_of(path) is not None


def split(path) -> tuple[str, str]:
    """(bucket, key) of an object-store URL; the key without leading or trailing slashes."""
    bucket, _, key = str(path).split("://", 1)[1].partition("/")
    return bucket, key.strip("/")


@dataclasses.dataclass(frozen=True)
class S3Settings:
    endpoint: str | None  # None: AWS itself
    region: str


def s3_settings() -> S3Settings:
    """The endpoint and region boto3 would use: the environment first, then the profile's config file."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint is None or region is None:
        profile = _profile_config()
        endpoint = endpoint or profile.get("endpoint_url")
        region = region or profile.get("region")
    return S3Settings(endpoint.rstrip("/") if endpoint else None, region or DEFAULT_S3_REGION)


def _profile_config() -> dict:
    """The active profile's section of ~/.aws/config (AWS_CONFIG_FILE, AWS_PROFILE), as botocore reads it."""
    try:
        import botocore.session  # installed with s3fs (the 's3' extra)
    except ImportError:
        return {}
    try:
        return dict(botocore.session.Session().get_scoped_config())
    except Exception:  # a profile named but not configured: the request itself reports it
        return {}


def endpoint(path) -> str:
    """Where requests for `path` go (for messages): the emulator's or server's URL when one is configured."""
    if store_of(path) == GCS:
        for name in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
            if os.environ.get(name):
                return os.environ[name].rstrip("/")
        return "https://storage.googleapis.com"
    if store_of(path) == S3:
        settings = s3_settings()
        return settings.endpoint or f"https://s3.{settings.region}.amazonaws.com"
    return "its file system"


def s3_spec(path: str) -> dict:
    """TensorStore's `s3` kvstore spec of an s3:// URL, with the endpoint and region resolved here.

    Keys in the environment win over a profile, as in boto3; TensorStore is told so, or its default chain
    also parses ~/.aws/config and logs five error lines per open where that file does not exist."""
    bucket, key = split(path)
    settings = s3_settings()
    spec = {"driver": "s3", "bucket": bucket, "path": key, "aws_region": settings.region}
    if settings.endpoint:
        spec["endpoint"] = settings.endpoint
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def drop_cached_listings(path) -> None:
    """Drops fsspec's cached listings for `path`'s store: gcsfs and s3fs cache directory listings per
    process, and a verifier polling for new steps, or a trainer asking which steps are committed after a
    background save, must see the bucket as it is now."""
    store = store_of(path)
    if store is None:
        return
    import fsspec  # installed with the 'gcs' or 's3' extra

    if store == GCS:
        for kwargs in ({"finalize_on_close": True}, {}):  # the instances epath and gcsfs users create
            fsspec.filesystem("gcs", **kwargs).invalidate_cache()
    else:
        fsspec.filesystem("s3").invalidate_cache()
