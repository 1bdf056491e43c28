"""One short line naming a fault's root cause, whatever library raised it.

Orbax, TensorStore, gcsfs, s3fs and asyncio wrap one root cause in several layers; TensorStore appends
a 60-line JSON spec. A fault must read as one line, so these name the cause a person acts on.
Below every other package of ours: the entry points' one line and the checkpoint errors use it.
"""

import errno
import os
import re

_CAUSES = (
    ("no space left on device", ("no space left on device", "os_error_code='28'", "enospc")),
    ("unreachable", ("cannot connect to host", "connection refused", "connect call failed",
                     "couldn't connect to server", "failed to connect", "network is unreachable",
                     "could not resolve host", "name or service not known", "connection reset",
                     "could not connect to the endpoint url")),
    # S3's refusals of the key itself (a wrong or expired key, a wrong secret): the credentials, not a file.
    ("credentials refused", ("invalidaccesskeyid", "signaturedoesnotmatch", "expiredtoken", "invalidtoken",
                             "access key id you provided does not exist", "signature we calculated does not match")),
    ("file truncated", ("truncated", "unexpected end of", "end of file", "data_loss", "out_of_range")),
    ("file missing", ("not_found", "no such file or directory")),
    ("read-only file system", ("read-only file system", "os_error_code='30'", "erofs")),
    ("permission denied", ("permission denied", "permission_denied", "accessdenied", "access denied")),
    ("input/output error", ("input/output error", "os_error_code='5'")),
)
# Causes that are the data itself, not the medium that failed to deliver it: a read cannot cure them.
_DAMAGE = ("file truncated", "file missing")
_ERRNOS = {"no space left on device": errno.ENOSPC, "read-only file system": errno.EROFS,
           "input/output error": errno.EIO}


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and everything it was raised from or during (causes, contexts, group members)."""
    seen, order, todo = set(), [], [error]
    while todo and len(order) < 50:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        order.append(err)
        todo += [err.__cause__, err.__context__, *getattr(err, "exceptions", ())]
    return order


def _endpoint(text: str) -> str:
    """The host:port a connection error names, as the URL the environment gives it if any."""
    match = re.search(r"(?:host|connect to|server at)\s+'?([\w.\-\[\]:]+:\d+)", text, re.IGNORECASE)
    host = match.group(1) if match else ""
    for name in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        url = os.environ.get(name, "")
        if url and (not host or host in url):
            return url.rstrip("/")
    return host or "the storage endpoint"


def one_line_cause(error: BaseException) -> str:
    """One short line naming the root cause of `error` and its whole chain, e.g.
    "no space left on device", "endpoint http://127.0.0.1:8080 unreachable", "file truncated";
    otherwise the innermost message's first line, without TensorStore's spec, at most 200 characters.
    """
    chain = _chain(error)
    texts = [f"{type(err).__name__}: {err}".lower() for err in chain]
    for cause, markers in _CAUSES:
        hits = [i for i, (err, text) in enumerate(zip(chain, texts))
                if any(marker in text for marker in markers)
                or cause in _ERRNOS and getattr(err, "errno", None) == _ERRNOS[cause]]
        if not hits:
            continue
        if cause == "unreachable":
            return f"endpoint {_endpoint(str(chain[hits[-1]]))} unreachable"
        if cause in ("file missing", "file truncated", "input/output error"):
            text = str(chain[hits[-1]])
            path, leaf = _quoted_path(text), re.search(r'Error (?:reading|writing) "([^"/]+)/', text)
            return (f"{cause}: {path}" if path else cause) + (f" (leaf {leaf.group(1)})" if leaf else "")
        return cause
    root = chain[-1] if chain else error
    text = str(root).split(" [tensorstore_spec=")[0].strip().splitlines()
    line = text[0] if text else type(root).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def names_damage(error: BaseException) -> bool:
    """Whether `error`'s root cause is the data itself (a file truncated or missing): evidence against what
    was read. An error of the disk or the network (EIO, unreachable, a timeout, anything unknown) is not."""
    return one_line_cause(error).startswith(_DAMAGE)


def _quoted_path(text: str) -> str:
    """The first quoted file path in a TensorStore/OS message, if any."""
    match = re.search(r"['\"](/[^'\"]+|gs://[^'\"]+|s3://[^'\"]+)['\"]", text)
    return match.group(1) if match else ""
