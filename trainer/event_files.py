"""TensorBoard event files: process 0's writer, and the steps a resumed attempt takes back.

Process 0 writes `<workdir>/tensorboard/` (never under `checkpoints/`, which Orbax owns) through
tensorboardX's record format (no TensorFlow). Events are written in the loop's own thread and
flushed with each metrics.jsonl append, so a SIGKILL leaves in TensorBoard what it leaves in
metrics.jsonl (tensorboardX's SummaryWriter queues events for a thread of its own, which a kill
or a late full disk lost). On a gs:// workdir the events go to a local staging file that is
uploaded whole through the same storage layer as the checkpoints (at most every
UPLOAD_EVERY_SECS, and at close). Metrics are a convenience: a failing write warns once and
training goes on; the checkpoints' manifests record every loss.

One value per step: an attempt that resumed at step C recomputes every step from C, so before it
writes, the event files of earlier attempts lose their events at steps >= C (a killed or rolled-back
attempt's steps past C, and the interval scalars of its log lines there), but the eval of step C,
which the attempt that saved C computed and no later one does. Rewritten, not hidden: TensorBoard
merges every event file of the directory; its Rust loader drops a tag's records at steps >= s when
a record at s comes, its Python loader drops them only at a SessionLog START (which would take the
eval of step C too), and a script reading the files (tbparse, pandas) keeps both. So the files
hold one value per step, the one metrics.jsonl's reader returns (its last): the resumed attempt's.
Until that attempt has logged past the old one's last step, metrics.jsonl still holds old values
of steps it has not recomputed yet, which TensorBoard shows no more (as its Rust loader would not).
"""

import importlib
import itertools
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

from absl import logging
from etils import epath

from checkpointing.config import is_object_store
from checkpointing.errors import one_line_cause
from checkpointing.inspection import tensorboard_dir

EVAL_PREFIX = "eval/"  # the eval of a step: scalars RunMetrics.report_eval writes
UPLOAD_EVERY_SECS = 60.0
_LENGTH = struct.Struct("<Q")  # a record: its length, the length's masked crc32c, the bytes, theirs
_CRC = struct.Struct("<I")


_TENSORBOARDX = ("tensorboardX.proto.event_pb2", "tensorboardX.proto.summary_pb2", "tensorboardX.record_writer")
_PRELOAD: list[threading.Thread] = []


def preload() -> None:
    """Imports tensorboardX's protos on a thread (once per process): the first scalars then import nothing. On
    the loop's thread that import took ~0.7 s here and 1.7 s of a TPU v5e host's first log line (profiled); the trainer
    starts it before its compile (trainer/loop.py), whose XLA work leaves the interpreter free. A failed import
    is the first write's to report (it imports again)."""
    if not _PRELOAD and not all(name in sys.modules for name in _TENSORBOARDX):
        _PRELOAD.append(threading.Thread(target=_import_quietly, name="tensorboardX-import", daemon=True))
        _PRELOAD[0].start()


def _import_quietly() -> None:
    try:
        for name in _TENSORBOARDX:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001  reported by the write that needs it
        pass


def event_file_names(directory: str) -> list[str]:
    """The event files under `directory`, in the order TensorBoard reads them (by name: creation time)."""
    path = epath.Path(directory)
    return sorted(p.name for p in path.iterdir() if "tfevents" in p.name) if path.exists() else []


def records(data: bytes):
    """(start, end, payload) of each whole record of an event file's bytes; stops at a torn record (a
    writer killed in the middle of one). The checksums are not checked: a damaged record's payload
    fails to parse."""
    offset = 0
    while offset + 12 <= len(data):
        end = offset + 12 + _LENGTH.unpack_from(data, offset)[0] + 4
        if end > len(data):
            return
        yield offset, end, data[offset + 12:end - 4]
        offset = end


def frame(payload: bytes) -> bytes:
    """One record of `payload`, framed as TensorBoard reads it."""
    from tensorboardX.record_writer import masked_crc32c  # in functions: tensorboardX loads in ~0.4 s

    length = _LENGTH.pack(len(payload))
    return length + _CRC.pack(masked_crc32c(length)) + payload + _CRC.pack(masked_crc32c(payload))


def _kept(event, resumed_from: int):
    """The event as it stays in an earlier attempt's file: itself, a copy with fewer values, or None."""
    if not event.HasField("summary") or event.step < resumed_from:
        return event
    values = [v for v in event.summary.value if event.step == resumed_from and v.tag.startswith(EVAL_PREFIX)]
    if len(values) == len(event.summary.value):
        return event
    if not values:
        return None
    kept = type(event)()
    kept.CopyFrom(event)
    del kept.summary.value[:]
    kept.summary.value.extend(values)
    return kept


def pruned(data: bytes, resumed_from: int) -> tuple[bytes, int | None]:
    """(the file's bytes without the events an attempt resumed at `resumed_from` writes again, the
    file's first summary step (None: it has none)). A torn last record is dropped."""
    from tensorboardX.proto import event_pb2  # as in frame()

    pieces, first_step = [], None
    for start, end, payload in records(data):
        event = event_pb2.Event.FromString(payload)
        if event.HasField("summary") and first_step is None:
            first_step = event.step
        kept = _kept(event, resumed_from)
        if kept is event:
            pieces.append(data[start:end])  # kept whole: its bytes as written
        elif kept is not None:
            pieces.append(frame(kept.SerializeToString()))
    return b"".join(pieces), first_step


def prune_resumed(directory: str, resumed_from: int) -> list[str]:
    """Rewrites the event files under `directory` for an attempt resumed at `resumed_from` (see the module
    docstring); returns the names of the files it changed.

    Newest first, and only as far as needed: each attempt pruned the files before its own at its start,
    so once a file starts at or below `resumed_from`, the files before it hold only earlier steps."""
    changed = []
    for name in reversed(event_file_names(directory)):
        path = epath.Path(directory) / name
        data = path.read_bytes()
        kept, first_step = pruned(data, resumed_from)
        if kept != data:
            _replace(path, kept)
            changed.append(name)
        if first_step is not None and first_step <= resumed_from:
            break
    return changed


def _replace(path: epath.Path, data: bytes) -> None:
    """Replaces the file whole: on a local disk through a temporary file (no "tfevents" in its name, so
    TensorBoard never reads it; one writer per workdir, so one name, which the next prune overwrites if
    a kill left it) and a rename; an object (gs://, s3://) is replaced whole by its upload."""
    if is_object_store(path):
        path.write_bytes(data)
        return
    tmp = path.parent / "pruning.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EventWriter:
    """Scalars into this attempt's event file; the first failure warns once and turns writing off.

    `resumed_from`: the step this attempt started at; before its first event, the earlier attempts'
    events it recomputes are removed (prune_resumed). None: nothing is removed (a benchmark, a test)."""

    def __init__(self, workdir: str, resumed_from: int | None = None):
        preload()
        self._target = tensorboard_dir(workdir)
        self._remote = is_object_store(workdir)
        self._resumed_from = resumed_from
        self._path: str | None = None  # this attempt's event file (on an object store, its local staging copy)
        self._file = None  # that file, unbuffered: flush writes what is pending
        self._pending: list[bytes] = []
        self._broken = False
        self._uploaded_at = 0.0

    @property
    def enabled(self) -> bool:
        return not self._broken

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event at `step` holding every value; written out at the next flush."""
        if self._broken or not values:
            return
        try:
            from tensorboardX.proto import event_pb2, summary_pb2  # as in frame()

            self._open()
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                                                 for tag, value in values.items()])
            event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
            self._pending.append(frame(event.SerializeToString()))
        except Exception as err:  # a metrics write never stops training
            self._fail("write", err)

    def flush(self, force: bool = False) -> None:
        if self._broken or self._file is None:
            return
        try:
            data, self._pending = b"".join(self._pending), []
            while data:
                data = data[self._file.write(data):]
            if self._remote and (force or time.monotonic() - self._uploaded_at >= UPLOAD_EVERY_SECS):
                self._upload()
        except Exception as err:
            self._fail("flush", err)

    def close(self) -> None:
        """Writes out what is pending and, on an object store, uploads the file whole."""
        self.flush(force=True)
        if self._file is not None:
            self._file.close()
            self._file = None
            if self._remote:
                shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)  # the staging copy

    def _open(self) -> None:
        if self._file is not None:
            return
        from tensorboardX.proto import event_pb2  # as in frame()

        directory = tempfile.mkdtemp(prefix="tensorboard-") if self._remote else self._target
        os.makedirs(directory, exist_ok=True)  # first: a directory that cannot be made is the one warning
        if self._resumed_from is not None:
            self._prune()
        self._path = os.path.join(directory, self._new_name(directory))
        self._file = open(self._path, "xb", buffering=0)
        self._pending.append(frame(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
                                   .SerializeToString()))

    def _new_name(self, directory: str) -> str:
        """tensorboardX's name (creation second, host): TensorBoard reads the files in name order. An attempt
        that starts in the second of the previous one's file takes the next second, never that file."""
        for second in itertools.count(int(time.time())):
            name = f"events.out.tfevents.{second}.{socket.gethostname()}"
            if not os.path.exists(os.path.join(directory, name)) and not (
                    self._remote and (epath.Path(self._target) / name).exists()):
                return name

    def _prune(self) -> None:
        """The earlier attempts' events this one recomputes; a failure is a warning (TensorBoard may then
        show those steps twice), never the end of the metrics."""
        try:
            changed = prune_resumed(self._target, self._resumed_from)
        except Exception as err:
            logging.warning("metrics: cannot remove the TensorBoard events of steps >= %d (recomputed by this "
                            "attempt) from %s (%s); TensorBoard may show those steps twice", self._resumed_from,
                            self._target, one_line_cause(err))
            return
        if changed:
            logging.info("metrics: removed the TensorBoard events of steps >= %d from %s (this attempt "
                         "recomputes them)", self._resumed_from, ", ".join(changed))

    def _upload(self) -> None:
        """This attempt's file, copied whole over its last copy."""
        with open(self._path, "rb") as f:
            (epath.Path(self._target) / os.path.basename(self._path)).write_bytes(f.read())
        self._uploaded_at = time.monotonic()

    def _fail(self, what: str, err: Exception) -> None:
        self._broken, self._pending = True, []
        if self._file is not None:
            self._file.close()  # unbuffered: nothing left to write at exit
            self._file = None
        logging.warning("metrics: cannot %s TensorBoard events under %s (%s); training goes on without them",
                        what, self._target, one_line_cause(err))
