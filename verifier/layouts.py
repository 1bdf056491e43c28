"""The verifier's layouts: its own mesh, and the others over the same devices on which it replays an interval
again to measure the noise of a layout change for that run and interval (verifier/evidence.py).

The other meshes are its devices' other (data, model) sizes: the transposed one first (data=2 -> model=2:
the batch whole and the weights split, so every reduction runs in another order), then the rest. A
program that cannot be built on one (a batch the data axis does not divide) is skipped for the next.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from checkpointing.verification import compare
from runtime import mesh as mesh_lib
from verifier import evidence


def other_meshes(mesh) -> list:
    """Meshes over `mesh`'s devices with other (data, model) sizes, the transposed one first, and last one device
    alone (every reduction on one device: with two devices, the only third layout there is)."""
    count, shape = mesh.devices.size, dict(mesh.shape)
    current = (shape.get("data", 1), shape.get("model", 1))
    sizes = [current[::-1]] + sorted(((d, count // d) for d in range(1, count + 1) if count % d == 0),
                                     key=lambda size: -size[0])
    ordered = [size for i, size in enumerate(sizes) if size != current and size not in sizes[:i]]
    devices = list(mesh.devices.flat)
    meshes = [mesh_lib.build(dict(zip(mesh_lib.AXES, size)), devices) for size in ordered]
    if count > 1:
        meshes.append(mesh_lib.build({}, devices[:1]))
    return meshes


def as_tree_of(tree, like):
    """`tree`'s leaves in `like`'s tree: each program builds its own optimizer, a static part of its state."""
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))


def copy_onto(state, shardings):
    """A fresh copy of `state` on `shardings` (a step donates its input: a proved state must stay): moved there,
    then copied by an executable of its own. A transfer alone may alias: a replicated leaf moved to one of its
    own devices came back as that device's buffer, even with may_alias=False (jax 0.10.2)."""
    moved = jax.device_put(as_tree_of(state, shardings), shardings)
    return _copier(jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))(moved)


@functools.lru_cache(maxsize=16)
def _copier(treedef, shardings: tuple):
    return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=jax.tree.unflatten(treedef, shardings))


def moved_onto(state, shardings):
    """`state` (another layout's) on `shardings`, to be compared with this layout's."""
    return jax.device_put(as_tree_of(state, shardings), shardings)


def leaf_numbers(recorded, replays: list, anchor) -> dict[str, evidence.LeafNumbers]:
    """Per leaf, the norms evidence.judge_leaves needs, computed on device: `recorded` and every replay and
    `anchor` on the same shardings (replays of other layouts copied there first). Five floats a leaf reach
    the host."""
    values = _numbers(recorded, anchor, *replays)
    flat = jax.tree_util.tree_flatten_with_path(values)[0]
    rows = np.asarray(jax.device_get([v for _, v in flat])).reshape(-1, 5)
    leaves = jax.tree.leaves(recorded)
    found = {}
    for (path, _), row, leaf in zip(flat, rows, leaves):
        is_float = jnp.issubdtype(leaf.dtype, jnp.inexact)
        found[jax.tree_util.keystr(path)] = evidence.LeafNumbers(
            distance=float(row[0]), noise=float(row[1]), norm=float(row[2]), moved=float(row[3]),
            finite_replays=int(row[4]), replays=len(replays), is_float=bool(is_float),
            eps=float(jnp.finfo(leaf.dtype).eps) if is_float else 0.0)
    return found


@jax.jit
def _numbers(recorded, anchor, *replays):
    def one(r, a, *xs):
        if not jnp.issubdtype(r.dtype, jnp.inexact):  # integers: how many elements differ; noise 0
            differ = jnp.sum((r != xs[0]).astype(jnp.float32))
            return jnp.stack([differ, jnp.float32(0), jnp.float32(0), jnp.float32(0), jnp.float32(len(xs))])
        r32, a32 = r.astype(jnp.float32), a.astype(jnp.float32)
        x32 = [x.astype(jnp.float32) for x in xs]
        noise = jnp.max(jnp.stack([compare.norm(p - q) for i, p in enumerate(x32) for q in x32[i + 1:]]
                                  or [jnp.float32(0)]))
        finite = sum(jnp.all(jnp.isfinite(x)).astype(jnp.float32) for x in x32)  # the record's is checked intact
        return jnp.stack([compare.norm(r32 - x32[0]), noise, compare.norm(x32[0]), compare.norm(x32[0] - a32),
                          finite])

    return jax.tree.map(one, recorded, anchor, *replays)


# --- the platform: what decides the bits besides the layout -----------------------------------------

def platform_here() -> dict:
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind}


def same_platform(manifest: dict) -> bool:
    """Whether `manifest` was recorded on this backend and device kind (a manifest written before platforms
    were recorded: by this project's CPU runs, taken as this platform)."""
    recorded = manifest.get("platform")
    if not recorded:
        return True
    here = platform_here()
    return recorded.get("backend") == here["backend"] and recorded.get("device_kind") == here["device_kind"]


def same_layout(mesh, manifest: dict) -> bool:
    """Whether numbers recorded under `manifest` are reproducible here bit for bit: the same mesh in as many
    processes (gloo adds cross-process partial sums in another order) on the same platform."""
    return (dict(mesh.shape) == manifest["mesh"] and jax.process_count() == manifest["process_count"]
            and same_platform(manifest))


def describe_platform(platform: dict | None) -> str:
    if not platform:
        return "an unrecorded platform"
    return (f"{platform.get('device_kind') or platform.get('backend')} at {platform.get('matmul_precision', 'default')}"
            " matmul precision")


def verdict_of(judgement: evidence.Judgement, manifest: dict) -> tuple[str, str]:
    """(status, detail) of a judgement for a step recorded under `manifest`: evidence is a failure, except
    across platforms, where only an integer leaf decides. A TPU computes exp, log and its matmuls otherwise
    (a genuine transformer at --matmul_precision=highest, trained on a TPU v5e, replayed on CPU 191-3942x the
    noise of a layout change, docs/verifier.md): no layout noise measured here bounds that."""
    status = judgement.status
    if status == "fail" and not same_platform(manifest) and not any(f.exact for f in judgement.findings):
        return "inconclusive", (f"recorded on {describe_platform(manifest.get('platform'))}, verified on "
                                f"{platform_here()['backend']}: {judgement.findings[0].detail}; another platform "
                                "computes otherwise, so only a replay on the recording platform decides it")
    if status == "fail" and not same_platform(manifest):
        return "fail", next(f.detail for f in judgement.findings if f.exact)
    if status == "fail":
        return "fail", judgement.findings[0].detail
    if status == "inconclusive":
        return status, judgement.reason or ("no recorded quantity can decide: the noise of a layout change here is "
                                            "as large as the values (prove it on its recording layout)")
    where = "" if same_platform(manifest) else (f", recorded on {describe_platform(manifest.get('platform'))} and "
                                                f"verified on {platform_here()['backend']}")
    return "pass", judgement.describe() + where


NO_OTHER_LAYOUT = ("the verifier has no other layout of its devices to measure the noise of a layout change with "
                   "(give it 2 or more devices, or verify on the recording layout)")
