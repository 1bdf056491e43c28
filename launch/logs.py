"""Log set-up shared by every entry point: our absl INFO lines, the libraries' only when they matter."""

import logging as py_logging

from absl import logging

_CHATTY_LIBRARIES = ("/orbax/", "/jax/_src/", "/etils/")


class _QuietLibraries(py_logging.Filter):
    """Drops library records below WARNING (Orbax logs every barrier and path at INFO)."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        return record.levelno >= py_logging.WARNING or not any(lib in record.pathname for lib in _CHATTY_LIBRARIES)


def quiet_library_logs() -> None:
    logging.get_absl_handler().addFilter(_QuietLibraries())
