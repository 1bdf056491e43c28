"""Typed errors of the checkpoint service. Each message names what is wrong."""

from runtime.causes import one_line_cause  # noqa: F401  (re-exported: the errors' own wording)
from runtime.exit_codes import Fault


class CheckpointError(Fault):
    """Base class of every error the service raises (a fault: one line, exit 1, unless bad input)."""


class BadCheckpointRequest(CheckpointError, ValueError):
    """The request cannot be honoured without losing or overwriting something (exit code 2)."""


class NoSuchCheckpointError(BadCheckpointRequest):
    """A restore asked for a step that is not committed in the workdir."""


class TreeMismatchError(BadCheckpointRequest):
    """The checkpoint's tree differs from the restore target (paths added, removed, reshaped, retyped)."""


class ConfigMismatchError(BadCheckpointRequest):
    """Fields that must not change across a resume differ between the checkpoint and this run."""


class ManifestError(CheckpointError):
    """A manifest is missing, is not JSON, or does not match the schema."""


class FingerprintMismatchError(CheckpointError):
    """A restored leaf's fingerprint differs from the one taken at save time."""

    def __init__(self, message: str, *, path: str, expected: int, actual: int | None):
        super().__init__(message)
        self.path, self.expected, self.actual = path, expected, actual


class AsyncSaveError(CheckpointError):
    """A background save failed; the step it was writing never became committed."""

    # Set when Orbax's finalize thread still waits for the other processes of a pod (a write that failed
    # here only): the process exits once its line is written, without joining that thread (runtime/logs.py).
    exit_at_once = False


class VerificationFailedError(CheckpointError):
    """The verifier wrote failing verdicts (its exit 1 and last line name the steps)."""


class CorruptCheckpointError(CheckpointError):
    """A committed step could not be read back (its data is missing or damaged)."""


class WorkdirLeasedError(BadCheckpointRequest):
    """Another live writer holds the workdir's lease (checkpointing/_src/lease.py); nothing was written."""


class LeaseLostError(CheckpointError):
    """This writer's lease was taken over (it stalled past its expiry); it must stop writing."""


class StepAlreadyCommittedError(BadCheckpointRequest):
    """A save named a step that is already committed; a save never overwrites or deletes one."""

    def __init__(self, message: str, *, step: int, path: str):
        super().__init__(message)
        self.step, self.path = step, path


class StorageUnavailableError(CheckpointError):
    """The workdir's storage did not answer (an unreachable endpoint, no answer in time, an I/O error)."""


class InputStateError(BadCheckpointRequest):
    """A step's input iterator state cannot be restored by this run: saved by another process count,
    or saved with an iterator this run does not pass (or the reverse). Nothing was changed."""
