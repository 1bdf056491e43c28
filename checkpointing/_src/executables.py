"""Compiled executables kept on local disk, so that a relaunch loads one without tracing or lowering it.

JAX's persistent compilation cache saves a relaunch the compile, not the trace and the lowering that
compute its key: for the save marks' fingerprints, which every relaunch compiles before its restore
(checkpointing/_src/marks.py), those cost 0.05-0.1 s of the 0.1-0.2 s on the benchmark's mlp, on the cores the
step uses. Here the compiled executable itself is kept, under a key of everything it was compiled from:
the versions of jax, jaxlib and NumPy, the backend, this process and the devices, every argument leaf's path,
shape, dtype and sharding, JAX's configuration and XLA's flags, and the source of the modules that define the
function. A key that misses compiles; a file that cannot be read or loaded is one warning and a compile.
Each file carries its bytes' digest, so a torn write is never loaded.

The files live in `executables/` under JAX's cache directory (`jax_compilation_cache_dir`, local paths
only), so a run without the persistent cache keeps none. What is written is always compiled here with the
persistent cache off: on CPU (jax 0.10.2) an executable that JAX loaded from its cache serializes without
some of its kernels, and the copy then fails at its first call ("Function ... not found").
"""

import contextlib
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from types import ModuleType

import jax
import numpy as np
from absl import logging
from jax.experimental import serialize_executable

from checkpointing.errors import one_line_cause

_MAGIC = b"jax-checkpoint-service executable v1\n"


def directory() -> str | None:
    """Where executables are kept: beside JAX's persistent cache (a local path), else None (nothing kept)."""
    path = jax.config.jax_compilation_cache_dir
    if not path or "://" in path:
        return None
    return os.path.join(path, "executables")


def load_or_compile(name: str, make_jit: Callable[[], Callable], abstract_args: tuple,
                    sources: Sequence[ModuleType]) -> tuple[jax.stages.Compiled, str]:
    """(the executable of `make_jit()` for `abstract_args`, where it came from: "disk" or "compiled").

    `make_jit` returns a new jitted function each call (its executable must not come from jit's own
    caches); `sources` are the modules whose code it runs. Without a directory() this is `.lower().compile()`.
    """
    where = directory()
    if where is None:
        return make_jit().lower(*abstract_args).compile(), "compiled"
    compiled = load_kept(name, abstract_args, sources)
    if compiled is not None:
        return compiled, "disk"
    with _persistent_cache_off():
        compiled = make_jit().lower(*abstract_args).compile()
    _write(_path(where, name, abstract_args, sources), compiled)
    return compiled, "compiled"


def load_kept(name: str, abstract_args: tuple, sources: Sequence[ModuleType]) -> jax.stages.Compiled | None:
    """The executable load_or_compile kept for these arguments, or None (none kept, or unreadable). It compiles
    nothing and changes no setting, so it may run on a thread beside another compile."""
    where = directory()
    return None if where is None else _load(_path(where, name, abstract_args, sources), abstract_args)


def _path(where: str, name: str, abstract_args: tuple, sources: Sequence[ModuleType]) -> str:
    return os.path.join(where, f"{name}-{key(abstract_args, sources)}.executable")


def key(abstract_args: tuple, sources: Sequence[ModuleType]) -> str:
    """A digest of everything the executable of a function of `sources` for `abstract_args` depends on."""
    backend = jax.devices()[0].client
    parts = [jax.__version__, importlib.metadata.version("jaxlib"), np.__version__, backend.platform,
             backend.platform_version, jax.process_index(), jax.process_count(),
             jax.tree.structure(abstract_args).num_leaves,
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
             sorted((name, repr(value)) for name, value in jax.config.values.items())]
    # Leaves by path, not the treedef's repr: that holds a TrainState's functions' addresses, new each launch.
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_args)[0]:
        sharding = leaf.sharding
        devices = [(d.id, d.process_index, d.device_kind) for d in sharding._device_assignment]
        parts.append((jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype), repr(sharding), devices))
    digest = hashlib.sha256(repr(parts).encode())
    for module in sources:
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:32]


_UNLOADABLE: set[str] = set()  # warned about once: a second try (load_kept, then load_or_compile) says nothing


def _load(path: str, abstract_args: tuple) -> jax.stages.Compiled | None:
    if path in _UNLOADABLE:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as err:
        _UNLOADABLE.add(path)
        logging.warning("executable %s is unreadable (%s); compiling instead", path, one_line_cause(err))
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not an executable file")
        digest, body = data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("its bytes do not match their digest (a torn write)")
        serialized, out_tree = pickle.loads(body)
        in_tree = jax.tree.structure((abstract_args, {}))
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
    except Exception as err:  # noqa: BLE001  a kept executable only saves time: any failure compiles
        _UNLOADABLE.add(path)
        logging.warning("executable %s cannot be loaded (%s); compiling instead", path, one_line_cause(err))
        return None


def _write(path: str, compiled: jax.stages.Compiled) -> None:
    try:
        serialized, _, out_tree = serialize_executable.serialize(compiled)
        body = pickle.dumps((serialized, out_tree))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Renamed into place whole: a reader sees the old file, the new one or none (never fsynced: a lost
        # or torn file fails its digest and is compiled again).
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
        _UNLOADABLE.discard(path)
    except Exception as err:  # noqa: BLE001  as JAX's own cache writer: a cache write never fails a run
        logging.warning("executable %s not kept (%s); the next launch compiles it again", path,
                        one_line_cause(err))


@contextlib.contextmanager
def _persistent_cache_off():
    # JAX decides once per process whether its cache is used; reset_cache() makes it decide again (no public
    # switch does after the first compile).
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
