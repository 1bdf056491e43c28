"""Why a proof did not run to its end: evidence against the step (its verdict is `fail`), or a fault of
the verifier's own (`error`: written with complete=false, so the next verifier run retries it; never the
checkpoint's fail). The one place that split is made (verifier/proofs.py and verifier/verifier.py ask).

Evidence, from the step's own files:
  - its manifest damaged: not JSON, the schema, its digest, a `step` other than its directory's, a file
    of it missing (ManifestError, CorruptCheckpointError from checkpointing/_src/workdir.py read_manifest)
  - an array file truncated or missing (CorruptCheckpointError from checkpointing/_src/reads.py, or an OSError
    whose cause is the data itself)
  - a leaf's fingerprint, or the tree, other than the manifest's (FingerprintMismatchError, TreeMismatchError)
  - and, without an exception: a step that is not this run's (verifier/identity.py), a wrong counter or a
    NaN, a replay that differs (what a proof returns as its verdict).
A fault of the verifier, everything else:
  - the run's program cannot be imported, or its factory raises on the recorded config (ProgramError)
  - out of memory (XLA's RESOURCE_EXHAUSTED), too few devices for a mesh
  - the storage still failing after its retries (StorageUnavailableError: checkpointing/_src/reads.py)
  - any unexpected exception in the verifier's own code.
An exception out of a replay is never evidence: the step restored intact before it, and whatever a replay
decides comes back as a verdict; an exception there is about something else (an anchor, memory, storage).
"""

from checkpointing.errors import (CheckpointError, CorruptCheckpointError, FingerprintMismatchError, ManifestError,
                                  TreeMismatchError)
from runtime.causes import names_damage, one_line_cause

EVIDENCE = (FingerprintMismatchError, TreeMismatchError, ManifestError, CorruptCheckpointError)


class VerdictWriteError(CheckpointError):
    """A verdict could not be written (a full disk, the storage): a fault of the whole verifier, which stops
    (exit 1, one line), never a verdict about the step it was proving."""


def is_evidence(error: BaseException) -> bool:
    """Whether `error`, raised while restoring and checking a step, shows that the step itself is wrong."""
    if isinstance(error, EVIDENCE):
        return True
    return isinstance(error, OSError) and names_damage(error)


def is_missing_file(error: BaseException) -> bool:
    """Whether `error` is a file of the step missing: what a step being deleted file by file reads as."""
    return one_line_cause(error).startswith("file missing")


def cause(error: BaseException) -> str:
    """One line naming a fault of the verifier: its own message for the errors that name what failed
    (the program, the storage), 'out of memory' for XLA's RESOURCE_EXHAUSTED, else the type and root cause."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text:
        return f"out of memory on the verifier's devices ({_first_line(text)})"
    if isinstance(error, (CheckpointError, ValueError)) and text:  # ProgramError, StorageUnavailableError, ...
        return _first_line(text)
    return f"{type(error).__name__}: {one_line_cause(error)}"


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 300 else line[:297] + "..."
