"""Checkpoint benchmark: the service's costs as ratios against baselines measured in the same run.

A random float32 state (128 MiB arrays plus an int32 scalar 'step', `--state_gib` in all), fully
sharded over a data=4,model=2 mesh of 8 fake CPU devices (no replicas, so every variant moves
exactly the state's bytes), measured as:

  1. step blocking: how long an async `service.save()` holds the training step, over a
     synchronous save (async_save=False, save + wait) of the same state.        target <= 0.05
  2. total save: async save + wait until committed, over plain Orbax
     (`ocp.CheckpointManager(dir)`, default options, StandardSave + wait).       target <= 1.10
  3. cross-mesh restore: `service.restore` onto data=8 and onto model=8 layouts, over a restore
     onto the layout the step was saved from.
  4. the fingerprints computed inside the synchronous save(), over that save.
Every ratio is also shown without fingerprints: the time spent in `fingerprint_tree` (timed by a
wrapper around the service's own call) taken out of both sides.

Only ratios are judged: absolute times depend on the machine, its disk and page cache and what
else it runs, but both sides of a ratio see the same conditions. After one unmeasured warm-up
round (compilation, Orbax start-up) the variants run interleaved, in a rotated order each repeat,
each after a gc + sync; every ratio is a ratio of medians. Each save goes to a fresh directory
(Orbax never sees an existing step) that is deleted right after: disk use stays near 2x the state.

  PYTHONPATH=. .venv/bin/python -m benchmarks.checkpoint_bench [--state_gib=1] [--repeats=5]
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"  # both before jax is imported

import collections
import functools
import gc
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import app, flags, logging
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from checkpointing import fingerprint as fingerprint_lib
from checkpointing.service import CheckpointOptions, CheckpointService, RunMetadata

_STATE_GIB = flags.DEFINE_float("state_gib", 1.0, "Size of the float32 state, GiB (128 MiB arrays).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Measured rounds (each runs every variant once).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A fresh temporary directory is made under this "
                               "(default /tmp) and deleted at the end.")

LEAF_SHAPE = (8192, 4096)  # 128 MiB of float32
SAVED_MESH = {"data": 4, "model": 2}
RUN = RunMetadata(config={"bench": True}, fixed_fields={}, fixed_hash="bench", mesh=SAVED_MESH)
# name -> (mesh axis sizes, partition spec of each array) of a restore target.
LAYOUTS = {"same": ((4, 2), P("data", "model")),
           "data=8": ((8, 1), P("data", None)),
           "model=8": ((1, 8), P(None, "model"))}


def shardings(layout: str, num_arrays: int) -> dict:
    mesh_shape, spec = LAYOUTS[layout]
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tree = {f"w{i}": NamedSharding(mesh, spec) for i in range(num_arrays)}
    tree["step"] = NamedSharding(mesh, P())
    return tree


def random_state(num_arrays: int) -> dict:
    """Random arrays created directly in their shards (no host copy of the state)."""
    target = shardings("same", num_arrays)
    make = jax.jit(lambda key: jax.random.normal(key, LEAF_SHAPE, jnp.float32), out_shardings=target["w0"])
    state = {f"w{i}": make(jax.random.key(i)) for i in range(num_arrays)}
    state["step"] = jax.device_put(jnp.int32(0), target["step"])
    return jax.block_until_ready(state)


def settle() -> None:
    """Frees the last variant's host buffers and flushes its writes, so that neither the kernel's
    delayed write-back nor the garbage collector lands in the next measurement."""
    gc.collect()
    os.sync()
    _FINGERPRINT_SECONDS.clear()


_FINGERPRINT_SECONDS: list[float] = []  # time spent in fingerprint_tree since the last settle()
_fingerprint_tree = fingerprint_lib.fingerprint_tree


def _timed_fingerprint_tree(tree):
    """The service's own fingerprint call, unchanged, plus a clock (installed by main())."""
    started = time.perf_counter()
    try:
        return _fingerprint_tree(tree)
    finally:
        _FINGERPRINT_SECONDS.append(time.perf_counter() - started)


class Bench:
    def __init__(self, root: str, state: dict):
        self.root, self.state, self.step = root, state, 0
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.abstract = {layout: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                              state, shardings(layout, len(state) - 1)) for layout in LAYOUTS}
        self.restore_service = CheckpointService(os.path.join(root, "restore_src"),
                                                 CheckpointOptions(async_save=False), run=RUN)
        self.restore_service.save(1, state, losses={}, reason="interval")

    def record(self, measured: bool, **seconds: float) -> None:
        """Each time, and the same less the fingerprinting done meanwhile (as '<name>-fp')."""
        fingerprint = sum(_FINGERPRINT_SECONDS)
        for name, value in seconds.items():
            logging.info("%s%s: %.3fs (fingerprints %.3fs)", name, "" if measured else " (warm-up)", value, fingerprint)
            if measured:
                self.times[name].append(value)
                self.times[f"{name}-fp"].append(value - fingerprint)
        if measured and "sync_save" in seconds:
            self.times["fingerprint"].append(fingerprint)

    def save(self, kind: str, measured: bool) -> None:
        """kind: 'sync' or 'async' (our service), or 'orbax' (a plain CheckpointManager, default options)."""
        self.step += 1  # a fresh directory and step each time
        directory = os.path.join(self.root, f"save_{self.step}")
        if kind == "orbax":
            manager = ocp.CheckpointManager(directory)
            args = (self.step,), dict(args=ocp.args.StandardSave(self.state))
        else:
            manager = CheckpointService(directory, CheckpointOptions(async_save=kind == "async", max_to_keep=2), run=RUN)
            args = (self.step, self.state), dict(losses={}, reason="interval")
        started = time.perf_counter()
        manager.save(*args[0], **args[1])
        blocking = time.perf_counter() - started
        manager.wait_until_finished()
        total = time.perf_counter() - started
        manager.close()
        shutil.rmtree(directory)
        if kind == "async":
            self.record(measured, async_blocking=blocking, async_total=total)
        else:
            self.record(measured, **{f"{kind}_save": total})

    def restore(self, layout: str, measured: bool) -> None:
        started = time.perf_counter()
        restored = jax.block_until_ready(self.restore_service.restore(1, self.abstract[layout]).state)
        seconds = time.perf_counter() - started
        del restored
        self.record(measured, **{f"restore[{layout}]": seconds})

    def variants(self):
        return ([functools.partial(self.save, kind) for kind in ("sync", "async", "orbax")]
                + [functools.partial(self.restore, layout) for layout in LAYOUTS])


def report(times: dict, state_gib: float, repeats: int) -> str:
    def median(name):
        return statistics.median(times[name])

    def raw(name):
        return f"{median(name):.3f}s [" + ", ".join(f"{t:.3f}" for t in times[name]) + "]"

    rows = [("async save() step-blocking / sync save", "async_blocking", "sync_save", 0.05),
            ("service async save + wait / plain Orbax save + wait", "async_total", "orbax_save", 1.10),
            ("restore onto data=8 / restore onto saved mesh", "restore[data=8]", "restore[same]", None),
            ("restore onto model=8 / restore onto saved mesh", "restore[model=8]", "restore[same]", None),
            ("fingerprints in save() / sync save", "fingerprint", "sync_save", None)]
    lines = [f"Checkpoint benchmark: {state_gib:g} GiB float32 state on 8 CPU devices; medians of {repeats} "
             "interleaved repeats, raw seconds in brackets. 'Without fingerprints': the time spent in "
             "fingerprint_tree (save's fingerprints, restore's check) taken out of both sides.", "",
             "| ratio | value | target | met | without fingerprints | numerator | denominator |",
             "|---|---|---|---|---|---|---|"]
    for label, num, den, target in rows:
        value = median(num) / median(den)
        met = "n/a" if target is None else ("yes" if value <= target else "NO")
        without = "-" if num == "fingerprint" else f"{median(num + '-fp') / median(den + '-fp'):.3f}"
        lines.append(f"| {label} | {value:.3f} | {'-' if target is None else f'<= {target:.2f}'} | {met} | "
                     f"{without} | {num} {raw(num)} | {den} {raw(den)} |")
    return "\n".join(lines)


def main(argv):
    del argv
    assert jax.device_count() == 8, jax.devices()
    num_arrays = max(1, round(_STATE_GIB.value * 1024 / 128))
    state_gib = num_arrays * 128 / 1024
    fingerprint_lib.fingerprint_tree = _timed_fingerprint_tree  # service.py calls it via the module
    root = tempfile.mkdtemp(prefix="checkpoint_bench_", dir=_WORKDIR.value or "/tmp")
    try:
        logging.info("state: %d x %s float32 (%.3f GiB) + step; workdir %s", num_arrays, LEAF_SHAPE, state_gib, root)
        bench = Bench(root, random_state(num_arrays))
        variants = bench.variants()
        for variant in variants:  # warm-up: compile fingerprints and restores, start Orbax
            settle()
            variant(measured=False)
        for repeat in range(_REPEATS.value):
            shift = repeat % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                settle()
                variant(measured=True)
        bench.restore_service.close()
        print(report(bench.times, state_gib, _REPEATS.value))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
