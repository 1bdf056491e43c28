"""Runs gcp-storage-emulator on 127.0.0.1, with what real GCS does and the emulator omits.

  python -m tests.gcs_emulator --port=P --bucket=B

Real GCS answers every media download with `x-goog-generation`; TensorStore reads an object's
generation from it and rejects a read without it ("Malformed StorageGeneration"). Real GCS also
refuses (412) a write or delete whose `ifGenerationMatch` is not the object's generation (0: the
object must not exist); the workdir lease (checkpointing/lease.py) relies on that. The emulator
(2026.7.19) does neither, so this wrapper adds both to its handlers and otherwise runs the
emulator unchanged (in memory, one request at a time, so a check-then-write is atomic).
"""

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects

_download = objects.download
_insert = objects.insert
_delete = objects.delete


def _download_with_generation(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the emulator already answered 404
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


def _honouring_preconditions(handler):
    def handle(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        data = request.data  # read the body first, whatever the answer, so the connection stays usable
        if wanted:
            meta = data.get("meta", {}) if isinstance(data, dict) else {}
            name = request.params.get("object_id") or request.query.get("name", [meta.get("name")])[0]
            try:
                current = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
            except Exception:  # not found
                current = "0"
            if current != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet",
                                         "errors": [{"reason": "conditionNotMet", "message": "conditionNotMet"}]}})
                return None
        return handler(request, response, storage, *args, **kwargs)

    return handle


def start(bucket: str, *, cwd: str, env: dict[str, str] | None = None, output=subprocess.DEVNULL,
          new_session: bool = False, timeout: float = 30) -> tuple[subprocess.Popen, dict[str, str]]:
    """This server on a free port of 127.0.0.1, answering: (its process, which the caller stops by PID,
    and the environment that points TensorStore and gcsfs at it)."""
    from launch.pod import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "tests.gcs_emulator", f"--port={port}", f"--bucket={bucket}"],
                              cwd=cwd, env=env or dict(os.environ), stdout=output, stderr=subprocess.STDOUT,
                              start_new_session=new_session)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                server.wait(timeout=30)
                raise RuntimeError("the GCS emulator did not start") from None
            time.sleep(0.1)
    return server, {"TENSORSTORE_GCS_HTTP_URL": url, "STORAGE_EMULATOR_HOST": url, "GOOGLE_CLOUD_PROJECT": "test",
                    # The emulator has no bucket-type (gRPC control) API: gcsfs would wait 60 s per bucket.
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    replacements = {_download: _download_with_generation, _insert: _honouring_preconditions(_insert),
                    _delete: _honouring_preconditions(_delete)}
    # The router looks handlers up in its table, and falls back to objects.insert by name.
    objects.download, objects.insert = replacements[_download], replacements[_insert]
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler in replacements:
                handlers[method] = replacements[handler]
    server.create_server("127.0.0.1", args.port, in_memory=True, default_bucket=args.bucket).run()


if __name__ == "__main__":
    main()
