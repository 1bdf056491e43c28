"""Typed errors of the input pipeline: each names the path or the field, on one line.

All are ValueErrors, so an entry point under runtime/entry.py's run() exits 2 with the line.
"""


class DataError(ValueError):
    """Bad input data: a glob, a record file, a corpus or a dataset identity."""


class NoRecordFilesError(DataError):
    def __init__(self, pattern: str):
        super().__init__(f"--data=records:{pattern}: the glob matches no file")
        self.pattern = pattern


class RecordFileError(DataError):
    """A record file that is missing, truncated, corrupt or not of the dataset's record size."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


class DatasetChangedError(DataError):
    """A resume or a verification against other files than the run recorded."""

    def __init__(self, field: str, recorded, current):
        super().__init__(f"the dataset changed since it was recorded: {field} was {recorded!r}, is now {current!r}")
        self.field, self.recorded, self.current = field, recorded, current


class CorpusError(DataError):
    """Bad input to `prepare`: the corpus folder, its files or the flags."""
