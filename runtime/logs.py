"""Log set-up shared by every entry point: our absl INFO lines, the libraries' only when they matter.

A fault must end stderr with one line naming the step, the path and the cause. Orbax logs each
background failure with a traceback from every worker thread, TensorStore appends a 60-line spec,
asyncio reports the same exception again when its future is collected ("never retrieved"), and
TensorStore's completion callbacks print "Event loop is closed" tracebacks once Orbax's loop is
gone. Here each library record becomes one line (its message and its root cause) and the echoes
are dropped; our own records and tracebacks are left as they are.

Orbax logs a failure it hands back to its caller in every thread the failure passes through (about
six records per failed save, each with its exception): the caller (the service, the saver) names
it in one line of its own, so those records are shown at --v=1 only, as debug lines. So are the
libraries' INFO records (Orbax's barriers, paths and timings at every save); a library's warnings,
and its errors without an exception, stay one line each.
"""

import logging as py_logging
import os
import sys
import threading

from absl import logging

from runtime import exit_codes
from runtime.causes import one_line_cause

_CHATTY_LIBRARIES = ("/orbax/", "/jax/_src/", "/etils/", "/tensorstore/", "/gcsfs/", "/fsspec/", "/aiohttp/",
                     "/asyncio/", "/concurrent/futures/", "/s3fs/", "/botocore/", "/aiobotocore/")
# Echoes of a failure already reported (by Orbax's own record, then by our one line).
_ECHOES = ("exception was never retrieved", "event loop is closed", "cannot schedule new futures after")
_MAX_LINE = 300


def _one_line(text: str) -> str:
    line = text.split(" [tensorstore_spec=")[0].strip().splitlines()
    line = line[0] if line else ""
    return line if len(line) <= _MAX_LINE else line[:_MAX_LINE - 3] + "..."


class _QuietLibraries(py_logging.Filter):
    """Library records one line each: their INFO, and Orbax's failures its caller reports, at --v=1 only."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        if not any(lib in record.pathname for lib in _CHATTY_LIBRARIES):
            return True
        verbose = logging.get_verbosity() >= 1  # --v=1
        if record.levelno < py_logging.INFO or (record.levelno < py_logging.WARNING and not verbose):
            return False
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if any(echo in f"{message} {error}".lower() for echo in _ECHOES):
            return False
        if _handed_back(record, error):
            if not verbose:
                return False
            record.levelno, record.levelname = py_logging.DEBUG, py_logging.getLevelName(py_logging.DEBUG)
        line = _one_line(message)
        cause = one_line_cause(error) if error is not None else ""
        record.msg, record.args = line + (f" ({cause})" if cause and cause.lower() not in line.lower() else ""), None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _handed_back(record: py_logging.LogRecord, error: BaseException | None) -> bool:
    """An Orbax error logged with its exception on the way to the caller, which reports it itself."""
    return error is not None and "/orbax/" in record.pathname and record.levelno >= py_logging.ERROR


def _is_echo(error: BaseException | None) -> bool:
    return error is not None and any(echo in str(error).lower() for echo in _ECHOES)


def quiet_library_logs() -> None:
    logging.get_absl_handler().addFilter(_QuietLibraries())
    # Exceptions that reach no caller: TensorStore's completion callbacks print theirs through
    # sys.excepthook once Orbax's event loop is closed; threads and finalizers during shutdown.
    # Only the echoes are dropped; anything else keeps its traceback.
    hooks = (sys.excepthook, threading.excepthook, sys.unraisablehook)

    def excepthook(kind, error, traceback):
        if not _is_echo(error):
            hooks[0](kind, error, traceback)

    def thread_hook(args):
        if not _is_echo(args.exc_value):
            hooks[1](args)

    def unraisable_hook(args):
        if not _is_echo(args.exc_value):
            hooks[2](args)

    sys.excepthook, threading.excepthook, sys.unraisablehook = excepthook, thread_hook, unraisable_hook


def exit_at_once(code: int, line: str) -> None:
    """`line` last on stderr, then exit `code` at once: no thread is joined, no handler runs."""
    logging.flush()
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


def exit_failure(message: str, error: BaseException | None = None) -> None:
    """The fault's one line (`error: ...`), last on stderr, then exit FAILURE.

    The whole exception chain is logged at verbosity 1 (`--v=1`) just before it. An error whose
    `exit_at_once` is set (checkpointing.AsyncSaveError) exits without waiting for the other threads.
    """
    if error is not None:
        logging.vlog(1, "the fault in full:", exc_info=(type(error), error, error.__traceback__))
    logging.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    if getattr(error, "exit_at_once", False):  # a thread that may never end (a peer's barrier) is not joined
        sys.stdout.flush()
        os._exit(exit_codes.FAILURE)
    sys.exit(exit_codes.FAILURE)
