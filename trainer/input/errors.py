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

    PREFIX = "the dataset changed since it was recorded: "

    def __init__(self, field: str, recorded, current, *, what: str | None = None):
        self.what = what or f"{field} was {recorded!r}, is now {current!r}"
        super().__init__(self.PREFIX + self.what)
        self.field, self.recorded, self.current = field, recorded, current

    def derived(self, *, label: str = "", hint: str = "") -> "DatasetChangedError":
        """The same difference of the same type, in the split `label` names, with `hint` appended."""
        changed = type(self).__new__(type(self))  # not its __init__: the subclasses take other arguments
        changed.__dict__.update(self.__dict__)
        if label:
            changed.field, changed.what = f"{label}: {self.field}", f"{label}: {self.what}"
        changed.args = (self.PREFIX + changed.what + hint,)
        return changed


class ContentChangedError(DatasetChangedError):
    """A file of the same name, size and record count whose bytes (their sha256) differ from those recorded."""

    def __init__(self, name: str, recorded: str, current: str | None):
        super().__init__(f"file {name}: sha256", recorded, current,
                         what=f"file {name}: its content changed (sha256 {recorded[:16]} recorded, "
                              f"{str(current)[:16]} now)")
        self.name = name


class CorpusError(DataError):
    """Bad input to `prepare`: the corpus folder, its files or the flags."""
