"""Runs moto's S3 server (a real HTTP S3 API, in memory) on 127.0.0.1, with what the tests need of it.

  python -m tests.s3_server --port=P --bucket=B

moto serves each request on a thread of its own and checks a conditional write (`If-None-Match: *`,
`If-Match: <etag>`) before it stores the object, not atomically with it: two racing creates could both
pass. Real S3 decides them atomically, and the workdir lease relies on that, so conditional writes and
deletes are serialized here. moto accepts any access key; this server refuses (403 InvalidAccessKeyId)
every key but ACCESS_KEY, as S3 refuses a key it does not know. Beyond moto, two endpoints for the tests:
  - GET /_requests[?clear=1]: the S3 requests answered since the log was last cleared (op, key, status,
    bytes), to count a save's and a restore's requests;
  - POST /_faults?status=503&count=N[&match=REGEX] or ?drop=N: the next N requests whose 'METHOD /path'
    REGEX finds are answered 503 SlowDown (403: AccessDenied), or their connection is closed unanswered;
  - POST /_conditions?honour=0|1: 0 drops If-None-Match and If-Match from writes, as an S3-compatible store
    without conditional writes would (the lease must then refuse to start).
"""

import argparse
import json
import os
import re
import socket
import subprocess
import threading
import urllib.parse
import urllib.request

ACCESS_KEY, SECRET_KEY, REGION = "test-key", "test-secret", "us-east-1"  # what moto accepts: any key

_LOG: list[dict] = []
_FAULTS: list[dict] = []  # {"status": 503 | None (drop), "count": n, "match": text}
_LOCK = threading.Lock()  # the log and the faults
_CONDITIONAL = threading.Lock()  # one conditional write at a time: check and store together, as S3 does
_HONOUR_CONDITIONS = [True]

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
              b'request rate.</Message></Error>')


_ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied'
                  b'</Message></Error>')
_ERRORS = {503: ("503 Slow Down", _SLOW_DOWN), 403: ("403 Forbidden", _ACCESS_DENIED)}  # what /_faults answers
_INVALID_KEY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
                b'Access Key Id you provided does not exist in our records.</Message></Error>')


def _access_key_id(environ: dict, query: dict) -> str | None:
    """The access key id a request is signed with (SigV4 header or presigned query); None if unsigned."""
    match = re.search(r"Credential=([^/]+)/", environ.get("HTTP_AUTHORIZATION", ""))
    if match:
        return match.group(1)
    credential = query.get("X-Amz-Credential", [""])[0]
    return credential.split("/")[0] if credential else None


class _Dropped(ConnectionError):
    """Raised inside the app once its socket is shut: werkzeug then answers nothing (a dropped connection)."""


def _operation(method: str, path: str, query: dict) -> tuple[str, str]:
    """(kind, key) of an S3 request in path style (/bucket/key)."""
    _, _, key = path.lstrip("/").partition("/")
    key = urllib.parse.unquote(key)
    if method == "GET":
        kind = "read" if key else "list"
        key = key or query.get("prefix", [""])[0]
    elif method == "HEAD":
        kind = "head"
    elif not key and method != "POST":
        kind = "other"  # the bucket itself
    elif method == "PUT":
        kind = "copy" if "x-amz-copy-source" in query else "write"
    elif method == "DELETE":
        kind = "delete"
    elif method == "POST":
        kind = "delete" if "delete" in query else "write"  # multi-object delete; multipart parts are writes
    else:
        kind = "other"
    return kind, key


def _app(moto_app):
    def app(environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        if path == "/_requests":
            with _LOCK:
                body = json.dumps(_LOG).encode()
                if query.get("clear"):
                    _LOG.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/_faults":
            status = None if "drop" in query else int(query["status"][0])
            count = int(query["drop" if status is None else "count"][0])
            with _LOCK:
                _FAULTS.append({"status": status, "count": count, "match": query.get("match", [""])[0]})
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        key_id = _access_key_id(environ, query)
        if key_id is not None and key_id != ACCESS_KEY:  # moto accepts any key; this server knows one
            body = _INVALID_KEY
            start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            _record(method, path, query, 403, 0, len(body))
            return [body]
        if path == "/_conditions":
            _HONOUR_CONDITIONS[0] = query.get("honour", ["1"])[0] == "1"
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        fault = _take_fault(f"{method} {path}")
        if fault is not None:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            if fault["status"] is None:
                _record(method, path, query, 0, 0, 0)
                environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
                raise _Dropped()
            line, body = _ERRORS[fault["status"]]
            start_response(line, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            _record(method, path, query, fault["status"], 0, len(body))
            return [body]
        headers = {k: v for k, v in environ.items() if k.startswith("HTTP_IF_")}
        if headers and method in ("PUT", "DELETE", "POST") and not _HONOUR_CONDITIONS[0]:
            for name in headers:
                del environ[name]
            headers = {}
        status = {}

        def noting_start_response(status_line, response_headers, *args):
            status["code"] = int(status_line.split()[0])
            return start_response(status_line, response_headers, *args)

        bytes_in = int(environ.get("CONTENT_LENGTH") or 0)
        if headers and method in ("PUT", "DELETE", "POST"):
            with _CONDITIONAL:
                body = b"".join(moto_app(environ, noting_start_response))
        else:
            body = b"".join(moto_app(environ, noting_start_response))
        _record(method, path, query, status.get("code", 0), bytes_in, len(body))
        return [body]

    return app


def _take_fault(request: str) -> dict | None:
    with _LOCK:
        for fault in _FAULTS:
            if fault["count"] > 0 and re.search(fault["match"], request):
                fault["count"] -= 1
                return fault
    return None


def _record(method: str, path: str, query: dict, status: int, bytes_in: int, bytes_out: int) -> None:
    if path.count("/") < 1 or path == "/":
        return
    kind, key = _operation(method, path, query)
    with _LOCK:
        _LOG.append({"op": kind, "method": method, "name": key, "status": status, "bytes_in": bytes_in,
                     "bytes_out": bytes_out})


def request_log(url: str, *, clear: bool = False) -> list[dict]:
    """The requests the server at `url` answered since its log was last cleared (see the docstring)."""
    with urllib.request.urlopen(f"{url}/_requests{'?clear=1' if clear else ''}", timeout=30) as answer:
        return json.load(answer)


def inject(url: str, *, count: int, status: int | None = 503, match: str = "") -> None:
    """The next `count` requests 'METHOD /bucket/key' that regex `match` finds get `status` (None: no answer)."""
    query = f"drop={count}" if status is None else f"status={status}&count={count}"
    request = urllib.request.Request(f"{url}/_faults?{query}&match={urllib.parse.quote(match)}", method="POST")
    urllib.request.urlopen(request, timeout=30).close()


def honour_conditions(url: str, honour: bool) -> None:
    """Whether the server at `url` honours conditional writes (see the docstring)."""
    request = urllib.request.Request(f"{url}/_conditions?honour={int(honour)}", method="POST")
    urllib.request.urlopen(request, timeout=30).close()


def client_env(url: str) -> dict[str, str]:
    """What points boto3, s3fs and TensorStore at the server at `url`: the standard AWS variables only."""
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def start(bucket: str, *, cwd: str, env: dict[str, str] | None = None, output=subprocess.DEVNULL,
          new_session: bool = False, timeout: float = 30) -> tuple[subprocess.Popen, dict[str, str]]:
    """This server on a free port of 127.0.0.1 with `bucket` made, answering: (its process, which the caller
    stops by PID, and the environment that points the clients at it)."""
    from tests import helpers

    server, url = helpers.start_test_server("tests.s3_server", bucket, f"/{bucket}", "S3 server", cwd=cwd, env=env,
                                            output=output, new_session=new_session, timeout=timeout, method="HEAD")
    return server, client_env(url)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    os.environ.setdefault("MOTO_PORT", str(args.port))
    moto_app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", args.port, _app(moto_app), threaded=True, request_handler=MotoRequestHandler)
    server.socket.listen(256)  # many clients at once (TensorStore's concurrent writes): no dropped connections
    import boto3  # the bucket, made through the server itself once it listens

    threading.Thread(target=server.serve_forever, daemon=True).start()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{args.port}", **_credentials()).create_bucket(Bucket=args.bucket)
    threading.Event().wait()


def _credentials() -> dict[str, str]:
    return {"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY, "region_name": REGION}


if __name__ == "__main__":
    main()
