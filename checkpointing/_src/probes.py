"""Probes: what the trainer recorded a few steps after each persistent save, for the verifier's cheap proof.

A checkpoint resumes the run if training on from it gives what the trainer itself computed after it.
So, `probe_steps` steps after a persistent save of step S, the trainer records the losses of steps
S .. S+k-1 and a per-leaf summary of its state at S+k: each leaf's sum and L2 norm, reduced on device
inside one jit (two float32 scalars per leaf cross to the host, once per save). Process 0 writes them to
`<workdir>/probes/<S>.json` once S has committed, naming S's manifest digest (a probe belongs to one
save, like a verdict), atomically and durably (checkpointing/_src/durable.py).

The verifier replays those k steps from the checkpoint and compares (verifier/resume_proof.py). Across
layouts the summaries need no tolerance of their own: |norm(a) - norm(b)| <= ||a - b|| and
|sum(a) - sum(b)| <= sqrt(n) ||a - b||, so the per-leaf state rule (verifier/tolerances.py) bounds both.

Where the state already lies in host memory (CPU devices) and process 0 holds each leaf whole
(`host_held`: data parallelism over processes, one process), process 0 sums its own shards with NumPy in
float64 (`host_summaries`): nothing is compiled, loaded or dispatched for them. A device executable for
the summaries cost every launch of the goodput benchmark's trainer about 0.2 s on 2 cores (its trace,
lowering and load, and a first run that sets up XLA's YNN reductions, ~1 ms each), against ~13 ms a probe
here (docs/performance.md). Elsewhere (accelerators, a leaf split across processes) they are reduced on
the devices, with the step's save marks (on_step dispatches them, checkpointing/_src/marking.py).

Fields: step, manifest_digest, losses {"<step>": float}, summary_step, summaries {path: [sum, norm]},
mesh {"axis": size}, process_count, recorded_at, summary_pass: "host" by host_summaries (the verifier
recomputes them the same way from its replayed state: bit-exact on the same layout); "step" when they were
the step's save marks (checkpointing/_src/marks.py; the verifier computes its replayed state's with the same
executable, so they stay bit-exact on the same layout); "separate" (or absent) by leaf_summaries, a pass of
its own.
"""

import datetime
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpointing._src import compare, durable
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CheckpointError, ManifestError, one_line_cause

_WARNED: set[str] = set()
# How the summaries were computed (the docstring's summary_pass).
STEP_PASS, SEPARATE_PASS, HOST_PASS = "step", "separate", "host"
PASSES = (SEPARATE_PASS, STEP_PASS, HOST_PASS)
_REQUIRED = {"step": int, "manifest_digest": str, "losses": dict, "summary_step": int, "summaries": dict,
             "mesh": dict, "process_count": int}


def leaf_summary(x: jax.Array) -> jax.Array:
    """float32[2]: the leaf's sum and L2 norm (a typed key's words, integers and bools as numbers)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = x.astype(jnp.float32)  # no reshape: a leaf sharded over an explicit mesh axis cannot be flattened
    return jnp.stack([jnp.sum(x), compare.norm(x)])


@functools.lru_cache(maxsize=8)
def _summary_fn(mesh: Mesh | None):
    summarize = lambda tree: jax.tree.map(leaf_summary, tree)
    if mesh is None:
        return jax.jit(summarize)
    return jax.jit(summarize, out_shardings=NamedSharding(mesh, P()))  # replicated: any process reads them


def leaf_summaries(tree):
    """A tree of float32[2] (sum, norm) per leaf, replicated on the tree's mesh; dispatched, not waited for."""
    return _summary_fn(getattr(jax.tree.leaves(tree)[0].sharding, "mesh", None))(tree)


def host_held(tree) -> bool:
    """Whether process 0 already holds every leaf of `tree` (arrays or ShapeDtypeStructs with shardings)
    whole in host memory: on CPU devices, its own devices' shards covering the leaf. Read from the shardings
    alone, so every process gets the same answer (the device pass is a collective: all or none take it)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not _held_by_process_zero(sharding, tuple(leaf.shape)):
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _held_by_process_zero(sharding, shape: tuple[int, ...]) -> bool:
    if any(device.platform != "cpu" for device in sharding.device_set):
        return False
    return covers(sharding.devices_indices_map(shape), shape, process=0)


def covers(indices: dict, shape: tuple[int, ...], process: int) -> bool:
    """Whether the devices of `process` in `indices` ({device: index}) hold every element of a leaf of
    `shape` between them (the shards of one sharding tile the leaf, so their distinct indices are disjoint)."""
    distinct = {_bounds(index, shape) for device, index in indices.items() if device.process_index == process}
    return sum(math.prod(stop - start for start, stop in bounds) for bounds in distinct) == math.prod(shape)


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def host_summaries(tree) -> dict[str, list[float]]:
    """{key path: [sum, norm]} of each leaf, from this process's own shards on the host (fetched there from
    an accelerator): float64 sums of the shards' values in pieces of _CHUNK, added in the shards' index
    order, so a layout always gives the same numbers (the squares of float32 values neither overflow nor
    underflow float64). NaN and Inf stay non-finite. ValueError when this process does not hold a leaf whole."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    piece = np.empty(_CHUNK, np.float64)  # one buffer for every piece: converted into, not allocated each time
    return {jax.tree_util.keystr(path): _host_summary(jax.tree_util.keystr(path), leaf, piece) for path, leaf in flat}


# Elements converted to float64 at a time: cache-sized pieces took 13 ms for the goodput benchmark's 45 MiB,
# whole leaves 22 ms (threads over the leaves gained nothing more on 2 cores). The size is part of the
# numbers (each piece is summed on its own): changing it changes every recorded summary's last bits.
_CHUNK = 1 << 16


def _host_summary(path: str, x: jax.Array, buffer: np.ndarray) -> list[float]:
    shape = tuple(x.shape)
    shards = {_bounds(shard.index, shape): shard for shard in x.addressable_shards}
    if sum(math.prod(stop - start for start, stop in bounds) for bounds in shards) != math.prod(shape):
        raise ValueError(f"leaf {path}: process {jax.process_index()} does not hold it whole")
    total = squares = 0.0
    for bounds in sorted(shards):
        data = shards[bounds].data
        if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(data)
        values = np.asarray(data).reshape(-1)  # bfloat16, integers and bools too: as numbers
        for start in range(0, values.size, _CHUNK):
            piece = buffer[:min(_CHUNK, values.size - start)]
            np.copyto(piece, values[start:start + _CHUNK], casting="unsafe")  # astype(float64)'s conversion
            total += float(piece.sum())
            squares += float(np.einsum("i,i->", piece, piece))
    return [total, math.sqrt(squares)]


def to_host(summaries) -> dict[str, list[float]]:
    """{key path: [sum, norm]} (one transfer)."""
    flat = jax.tree_util.tree_flatten_with_path(summaries)[0]
    values = np.asarray(jax.device_get([v for _, v in flat]), dtype=np.float64).reshape(-1, 2)
    return {jax.tree_util.keystr(path): [float(v[0]), float(v[1])] for (path, _), v in zip(flat, values)}


def make(*, step: int, manifest_digest: str, losses: dict[int, float], summary_step: int,
         summaries: dict[str, list[float]], mesh: dict, process_count: int, summary_pass: str = "separate") -> dict:
    probe = {"step": step, "manifest_digest": manifest_digest,
             "losses": {str(s): float(v) for s, v in sorted(losses.items())}, "summary_step": summary_step,
             "summaries": summaries, "mesh": dict(mesh), "process_count": process_count,
             "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    probe["summary_pass"] = summary_pass
    return validate(probe)


def validate(probe, where: str = "probe") -> dict:
    if not isinstance(probe, dict):
        raise ManifestError(f"{where}: not a JSON object")
    for field, kind in _REQUIRED.items():
        if not isinstance(probe.get(field), kind) or isinstance(probe.get(field), bool):
            raise ManifestError(f"{where}: field {field!r} must be {kind.__name__}")
    if probe.get("summary_pass", SEPARATE_PASS) not in PASSES:
        raise ManifestError(f"{where}: field 'summary_pass' must be one of {', '.join(map(repr, PASSES))}")
    if sorted(int(s) for s in probe["losses"]) != list(range(probe["step"], probe["summary_step"])):
        raise ManifestError(f"{where}: its losses are not those of steps {probe['step']}..{probe['summary_step'] - 1}")
    return probe


def losses(probe: dict) -> dict[int, float]:
    return {int(s): float(v) for s, v in probe["losses"].items()}


def write(workdir: str, probe: dict) -> None:
    """Readers see no file or the whole one; on a local disk durably (fsync, rename, fsync the directory)."""
    path = workdir_lib.probe_file(workdir, probe["step"])
    text = json.dumps(probe, indent=1, sort_keys=True)
    try:
        durable.make_dirs(path.parent)
        if durable.is_local(path):
            durable.write_text(path, text)
        else:
            path.write_text(text)  # a GCS object appears whole or not at all
    except OSError as err:
        raise CheckpointError(f"probe of step {probe['step']}: cannot write {path}: {one_line_cause(err)}") from err


def read(workdir: str, step: int) -> dict | None:
    """The step's probe, or None: none written, or a damaged file (warned about once; counts as none)."""
    path = workdir_lib.probe_file(workdir, step)
    try:
        return validate(json.loads(path.read_bytes().decode()), f"probe of step {step}")
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError, ManifestError) as err:
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            logging.warning("probe of step %d is damaged: %s: %s; its cheap proof waits for none", step, path,
                            one_line_cause(err))
        return None


def for_save(workdir: str, step: int, digest: str | None) -> dict | None:
    """The probe of the save of `step` whose manifest digest is `digest`, or None."""
    probe = read(workdir, step)
    return probe if probe is not None and digest is not None and probe["manifest_digest"] == digest else None
