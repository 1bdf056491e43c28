"""Typed errors of the checkpoint service. Each message names what is wrong."""


class CheckpointError(Exception):
    """Base class of every error the service raises."""


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


class CorruptCheckpointError(CheckpointError):
    """A committed step could not be read back (its data is missing or damaged)."""
