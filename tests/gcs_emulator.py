"""Runs gcp-storage-emulator on 127.0.0.1, with what real GCS does and the emulator omits.

  python -m tests.gcs_emulator --port=P --bucket=B

Real GCS answers every media download with `x-goog-generation`; TensorStore reads an object's
generation from it and rejects a read without it ("Malformed StorageGeneration"). Real GCS also
refuses (412) a write or delete whose `ifGenerationMatch` is not the object's generation (0: the
object must not exist); the workdir lease (checkpointing/_src/lease.py) relies on that. The emulator
(2026.7.19) does neither, so this wrapper adds both to its handlers and otherwise runs the
emulator unchanged (in memory, one request at a time, so a check-then-write is atomic).
"""

import argparse
import http.server
import json
import re
import subprocess
import urllib.parse
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


_LOG: list[dict] = []  # the emulator serves one request at a time: no lock needed


def _operation(method: str, path: str, query: dict) -> tuple[str, str]:
    """(kind, object name or listed prefix) of a GCS request, for the request log."""
    kind = {"DELETE": "delete", "PATCH": "patch", "PUT": "write"}.get(method, "other")
    name = ""
    match = re.search(r"/b/[^/]+/o(?:/(.*))?$", path)
    if match:
        name = urllib.parse.unquote(match.group(1) or "")
        if method == "GET":
            kind = "read" if "download" in path or query.get("alt") == ["media"] else "get" if name else "list"
            name = name or query.get("prefix", [""])[0]
        elif method == "POST":
            kind = "write" if path.startswith("/upload") else "copy" if name else "other"
            name = name or query.get("name", [""])[0]
    elif method == "POST" and "batch" in path:
        kind = "batch"
    elif method in ("GET", "PUT") and path.count("/") >= 2:  # XML API: /bucket/object
        kind = "read" if method == "GET" else "write"
        name = urllib.parse.unquote(path.split("/", 2)[2])
    return kind, name


def _logging_requests(handle):
    """Router.handle, recording each answered request in _LOG (the log's own endpoint aside)."""

    def logged(router, method):
        handler = router._request_handler
        handler.logged_bytes_in = 0
        handle(router, method)
        url = urllib.parse.urlparse(handler.path)
        if url.path == "/requests":
            return
        kind, name = _operation(method, url.path, urllib.parse.parse_qs(url.query))
        _LOG.append({"op": kind, "method": method, "name": name, "status": getattr(handler, "logged_status", 0),
                     "bytes_in": handler.logged_bytes_in, "bytes_out": getattr(handler, "logged_bytes_out", 0)})

    return logged


def _closing_with_size(close):
    def close_and_note(response):
        content = response._content
        response._handler.logged_bytes_out = len(content.encode() if isinstance(content, str) else content)
        response._handler.logged_status = response.status.value
        close(response)

    return close_and_note


def _reading_body_size(read):
    def read_and_note(request_handler):
        body = read(request_handler)
        request_handler.logged_bytes_in = len(body or b"")  # chunked uploads carry no Content-Length
        return body

    return read_and_note


def _requests(request, response, storage):
    response.json(list(_LOG))
    if request.query.get("clear"):
        _LOG.clear()


def request_log(url: str, *, clear: bool = False) -> list[dict]:
    """The requests the server at `url` answered since its log was last cleared (see the docstring)."""
    with urllib.request.urlopen(f"{url}/requests{'?clear=1' if clear else ''}", timeout=30) as answer:
        return json.load(answer)


def start(bucket: str, *, cwd: str, env: dict[str, str] | None = None, output=subprocess.DEVNULL,
          new_session: bool = False, timeout: float = 30) -> tuple[subprocess.Popen, dict[str, str]]:
    """This server on a free port of 127.0.0.1, answering: (its process, which the caller stops by PID,
    and the environment that points TensorStore and gcsfs at it)."""
    from tests import helpers

    server, url = helpers.start_test_server("tests.gcs_emulator", bucket, "/", "GCS emulator", cwd=cwd, env=env,
                                            output=output, new_session=new_session, timeout=timeout)
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
    # Real GCS accepts every connection; the stdlib's backlog of 5 would drop some of many concurrent
    # clients' connections for a second's retransmit (benchmarks/scale_sim.py runs 64).
    http.server.HTTPServer.request_queue_size = 256
    server.HANDLERS = ((r"^/requests$", {"GET": _requests}), *server.HANDLERS)
    server._read_raw_data = _reading_body_size(server._read_raw_data)
    server.Router.handle = _logging_requests(server.Router.handle)
    server.Response.close = _closing_with_size(server.Response.close)
    server.create_server("127.0.0.1", args.port, in_memory=True, default_bucket=args.bucket).run()


if __name__ == "__main__":
    main()
