"""JAX's persistent compilation cache for the trainer: where it lives, what it holds, and on CPU
pods, that every process can use it.

A restart that finds its executables here compiles nothing. JAX writes entries from process 0 only,
on the assumption that every process computes the same key. On a multi-process CPU run (jax
0.10.2) they do not: a key hashes the compile options and the device topology, which are each
process's own. So the other processes never found an entry, recompiled everything on every
restart, and the whole pod waited for them at its first collective. On CPU, each process
therefore also writes its own entries: its keys are its own, so no two processes write one file.
Elsewhere (TPU, GPU) JAX's rule stands: one writer per key.
"""

import os
import threading
import warnings

import jax
from absl import logging

from checkpointing.errors import one_line_cause

_HITS, _LOOKUPS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/compile_requests_use_cache"
_counts = {_HITS: 0, _LOOKUPS: 0}
_counts_lock = threading.Lock()


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-checkpoint-service", "compile")


def use(path: str) -> None:
    """Turns the cache on at `path` (before anything compiles); '' leaves it off.

    Every entry is cached (min compile time and size 0: the init and batch functions compile in
    well under JAX's default one second). An unusable directory, a corrupt entry or one JAX cannot
    load is one warning and a plain compile, never a crash: the cache only saves time.
    """
    if not path:
        return
    if "://" not in path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            logging.warning("compilation cache %s is unusable (%s); compiling without it", path, one_line_cause(err))
            return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.monitoring.register_event_listener(_count)
    _warn_once_about_entries(path)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        _let_this_process_write(path)


def lookups() -> tuple[int, int]:
    """(hits, lookups) of the persistent cache in this process so far."""
    with _counts_lock:
        return _counts[_HITS], _counts[_LOOKUPS]


def _count(event: str, **_) -> None:
    if event in _counts:
        with _counts_lock:
            _counts[event] += 1


def _warn_once_about_entries(path: str) -> None:
    show = warnings.showwarning
    warned = []

    # JAX warns once per bad entry; one line says it all (the run compiles what it cannot read).
    def show_once(message, category, *args, **kwargs):
        if "persistent compilation cache" not in str(message):
            return show(message, category, *args, **kwargs)
        if not warned:
            warned.append(message)
            logging.warning("compilation cache %s: %s; compiling instead (later cache errors are not logged)",
                            path, str(message).splitlines()[0])

    warnings.showwarning = show_once


def _let_this_process_write(path: str) -> None:
    """Wraps JAX's cache writer so that a process other than 0 writes its own entries too."""
    from jax._src import compilation_cache, compiler  # the writer and its storage (no public API)

    write = getattr(compiler, "_cache_write", None)
    if write is None or not hasattr(compilation_cache, "put_executable_and_time"):
        logging.warning("compilation cache %s: this jax (%s) lacks the writer this trainer wraps; processes "
                        "other than 0 will compile at every restart", path, jax.__version__)
        return
    failed = []

    def write_from_any_process(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if jax.process_index() == 0 or host_callbacks:
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as err:  # noqa: BLE001 (as JAX's own writer: a cache write never fails a run)
            if not failed:
                failed.append(err)
                logging.warning("compilation cache %s: cannot write an entry (%s); this process compiles at "
                                "every restart", path, one_line_cause(err))

    compiler._cache_write = write_from_any_process
