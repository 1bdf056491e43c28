"""Content digests: the sha256 of each leaf's values, in row-major order, as a proof binds them.

The fingerprints a manifest records (checkpointing/_src/fingerprint.py) are sums over elements, so any sharding
computes them on device at no cost; that is also why an adversary can forge arrays to match them (a sum of
per-element words can be matched by solving for a few elements, and any wider sum falls to a generalized
birthday search). They guard against accidents. What binds a proved step to its arrays is this digest: a
cryptographic hash of the leaf's bytes in one canonical order, which no layout changes, computed where a
process holds the whole leaf (the verifier, a single-process trainer, a replicated leaf in a pod). The
verifier records it in every passing verdict that proves a step (checkpointing/_src/verdicts.py), and a restore
that trusts the verdict (--resume_from=latest_verified, a proof anchored on that step) checks it: arrays
edited after their proof, with the manifest untouched, are refused by name.
"""

import concurrent.futures
import hashlib

import jax
import numpy as np

_WORKERS = 4  # hashlib releases the interpreter lock on large buffers: leaves hash in parallel


def leaf_digests(state) -> dict[str, str]:
    """{key path: sha256 hex} of every leaf this process holds whole (others left out): the dtype, the shape
    and the values in row-major order."""
    flat = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if _whole_here(leaf)]
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
        digests = list(pool.map(lambda item: _digest(item[1]), flat))
    return {path: digest for (path, _), digest in zip(flat, digests)}


def differing(state, recorded: dict[str, str]) -> list[str]:
    """The key paths whose digest here differs from `recorded` (leaves not held whole here: not compared)."""
    present = leaf_digests(state)
    return sorted(path for path, digest in recorded.items() if path in present and present[path] != digest)


def _whole_here(leaf) -> bool:
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable or leaf.is_fully_replicated


def _digest(leaf) -> str:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:  # replicated: this process's copy
        leaf = leaf.addressable_data(0)
    values = np.ascontiguousarray(jax.device_get(leaf))
    digest = hashlib.sha256(f"{values.dtype.name}{list(values.shape)}".encode())
    digest.update(values.reshape(-1).view(np.uint8).data if values.size else b"")
    return digest.hexdigest()
