"""One variant of the checkpoint benchmark, measured in a process of its own (see checkpoint_bench.py).

  python -m benchmarks.checkpoint_child --variant=NAME --state_gib=G --root=DIR [--samples=N]

makes the random state, runs the variant's cases in rounds (the first unmeasured: compiles,
Orbax start-up; then --samples measured, each in an order rotated each round, so both sides of
a ratio are measured seconds apart), and prints one JSON line: {"<case>.<value>": [samples]}.
The rss_* variants run once, unwarmed, and report the peak RSS above the live state (VmHWM after
resetting it through /proc/self/clear_refs).
Every timed code path is probed (benchmarks.common.CallProbe): a variant raises if the code it
names was not called, so a moved call breaks the benchmark instead of reading 0.
"""

import collections
import functools
import gc
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import flags

from benchmarks import common
from benchmarks.checkpoint_state import LAYOUTS, STATE_GIB, abstract_state, random_state, shardings, state_bytes
from checkpointing._src import content
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marking
from checkpointing._src import marks as marks_lib
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import orbax_hooks
from checkpointing._src import service as service_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing.config import CheckpointConfig
from checkpointing._src.service import CheckpointService, RunMetadata
from runtime import entry

_VARIANT = flags.DEFINE_enum("variant", None, ["saves", "passes", "restores", "rss_service_save", "rss_orbax_save",
                                                "rss_restore"], "What to measure (see VARIANTS).", required=True)
_ROOT = flags.DEFINE_string("root", None, "The benchmark's scratch directory.", required=True)
_SAMPLES = flags.DEFINE_integer("samples", 3, "Measured rounds of the variant's cases.", lower_bound=1)
_PIN_CALLER = flags.DEFINE_boolean("pin_caller", False, "Before each case, the calling thread on the first core "
                                   "and every other thread (XLA's device threads, Orbax's) on the others: disjoint "
                                   "cores for the caller and the work it dispatches.")

RUN = RunMetadata(config={"bench": True}, fixed_fields={}, fixed_hash="bench", mesh={"data": 4, "model": 2})
RESTORE_SOURCE = "restore_src"  # written by rss_service_save, read by every restore

# What save() calls while the caller waits, so its blocking time can be split up ('a/b': b runs inside a).
_MANAGER = orbax_hooks.Manager  # the service's Orbax manager
BLOCKING_PARTS = {
    "check_for_errors": (service_lib.CheckpointService, "check_for_errors"),
    "fingerprint_dispatch": (fingerprint_lib, "tree_fingerprints"),
    "leaf_table": (manifest_lib, "leaf_table"),
    "orbax_manager_save": (_MANAGER, "save"),
    "orbax_manager_save/preemption_query": (_MANAGER, "reached_preemption"),
}
PROBES = {name: common.CallProbe(*target) for name, target in BLOCKING_PARTS.items()}
PROBES["fingerprint_readback"] = common.CallProbe(fingerprint_lib, "to_ints")  # by the background write
PROBES["marks_readback"] = common.CallProbe(marks_lib, "fingerprint_ints")  # the step's, by the background write
# The restore's check, where the service calls it (checkpointing/_src/checks.py: the fingerprints, then the comparison).
PROBES["restore_fingerprint_check"] = common.CallProbe(service_lib, "check_fingerprints")


def settle() -> None:
    """Frees the last run's host buffers and flushes its writes, so neither lands in the next one."""
    gc.collect()
    os.sync()
    if _PIN_CALLER.value:
        common.pin_caller()


def require(*names: str, where: str) -> None:
    for name in names:
        PROBES[name].require_called(where)


def reset_probes() -> None:
    for probe in PROBES.values():
        probe.reset()


def open_save(kind: str, directory: str, state):
    """(manager, start) of one save. kind: 'sync' or 'async' (the service), 'orbax' (plain
    ocp.CheckpointManager, async by default), or 'orbax_two_items': plain Orbax saving the service's
    two items (the state, and a manifest without fingerprints as JSON): what the service's layout
    costs before any of its own work."""
    if kind in ("sync", "async"):
        manager = CheckpointService(directory, CheckpointConfig(async_save=kind == "async", max_to_keep=2), run=RUN)
        return manager, lambda: manager.save(1, state, losses={}, reason="interval")
    if kind == "async_marked":  # the fingerprints came with the state from the step that wrote it (untimed)
        manager = CheckpointService(directory, CheckpointConfig(async_save=True, max_to_keep=2), run=RUN)
        fingerprints = jax.block_until_ready(marks_of(state)[0])
        return manager, lambda: manager.save(1, state, losses={}, reason="interval", fingerprints=fingerprints)
    if kind == "orbax":
        manager = ocp.CheckpointManager(directory)
        return manager, lambda: manager.save(1, args=ocp.args.StandardSave(state))
    manager = ocp.CheckpointManager(directory, item_names=(workdir_lib.STATE_ITEM, workdir_lib.MANIFEST_ITEM))
    leaves = manifest_lib.leaf_table(state)
    manifest = manifest_lib.build(step=1, leaves=leaves, fingerprints=dict.fromkeys(leaves, 0), losses={},
                                  config=RUN.config, fixed_hash=RUN.fixed_hash, fixed_fields=RUN.fixed_fields,
                                  mesh=RUN.mesh, reason="interval")
    return manager, lambda: manager.save(1, args=ocp.args.Composite(**{
        workdir_lib.STATE_ITEM: ocp.args.StandardSave(state), workdir_lib.MANIFEST_ITEM: ocp.args.JsonSave(manifest)}))


def save(kind: str, directory: str, state) -> dict[str, float]:
    """One save (see open_save): save() blocking, save + wait, and for the service what save() blocked in."""
    manager, start = open_save(kind, directory, state)
    reset_probes()
    started = time.perf_counter()
    start()
    blocking = time.perf_counter() - started
    is_service = kind in ("sync", "async", "async_marked")
    parts = {f"part:{name}": PROBES[name].seconds for name in BLOCKING_PARTS} if is_service else {}
    if is_service:
        dispatches = kind != "async_marked"  # with the step's fingerprints save() dispatches no pass
        require(*(name for name in BLOCKING_PARTS if dispatches or name != "fingerprint_dispatch"),
                where=f"{kind} CheckpointService.save()")
        if not dispatches and PROBES["fingerprint_dispatch"].calls:
            raise RuntimeError("CheckpointService.save(fingerprints=) dispatched a fingerprint pass of its own")
    manager.wait_until_finished()
    total = time.perf_counter() - started
    manager.close()
    if is_service:
        require("marks_readback" if kind == "async_marked" else "fingerprint_readback",
                where=f"{kind} CheckpointService.save()'s background write")
    return {"blocking": blocking, "total": total, **parts}


def rounds(cases: dict) -> dict[str, list[float]]:
    """Runs every case once per round, in an order rotated each round; the first round is not kept."""
    names, samples = list(cases), collections.defaultdict(list)
    for round_ in range(_SAMPLES.value + 1):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            settle()
            result = cases[name]()
            for key, value in result.items():
                if round_:
                    samples[f"{name}.{key}"].append(value)
    return samples


def timed_saves() -> dict[str, list[float]]:
    state = random_state()

    def one(kind: str) -> dict[str, float]:
        directory = os.path.join(_ROOT.value, f"{kind}_save_{os.getpid()}")
        try:
            return save(kind, directory, state)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    kinds = ("sync", "async", "async_marked", "orbax", "orbax_two_items")
    return rounds({f"{kind}_save": lambda kind=kind: one(kind) for kind in kinds})


def passes() -> dict[str, list[float]]:
    """The fingerprint pass exactly as save() runs it (tree_fingerprints, then to_ints), the content digests a
    proving verdict records and a trusting restore checks (checkpointing/_src/content.py: sha256 of every leaf on
    the host), and one read of the state as their reference: a jitted sum over every leaf."""
    state = random_state()
    read = jax.jit(lambda tree: jax.tree.map(jnp.sum, tree), out_shardings=shardings("same")["step"])

    def timed(run) -> dict[str, float]:
        started = time.perf_counter()
        run()
        return {"secs": time.perf_counter() - started}

    return rounds({"state_read": lambda: timed(lambda: jax.block_until_ready(read(state))),
                   "fingerprint_pass": lambda: timed(
                       lambda: fingerprint_lib.to_ints(fingerprint_lib.tree_fingerprints(state))),
                   "content_digests": lambda: timed(lambda: content.leaf_digests(state)),
                   "plain_step": lambda: timed(lambda: jax.block_until_ready(marked_step(state, False))),
                   "marked_step": lambda: timed(lambda: jax.block_until_ready(marked_step(state, True)))})


@functools.cache
def _step():
    """A step writing every leaf (x + 1)."""
    return jax.jit(lambda state: jax.tree.map(lambda x: x + jnp.ones((), x.dtype), state),
                   out_shardings=shardings("same"))


def marks_of(state):
    """The state's marks with its fingerprints, as Checkpointer.on_step dispatches them (_src/marking.py)."""
    return marking.dispatch(state, fingerprints=True, summaries=False)


def marked_step(state, fingerprints: bool):
    """The step, then (asked) its output's marks: what a loop and its on_step run before a step-cadence save."""
    new = _step()(state)
    return (new, marks_of(new)) if fingerprints else new


def restore_target(layout: str) -> dict:
    """The abstract state of `layout`, with its save marks compiled: the trainer prepares them before its
    restore (Checkpointer.prepare), whose check then dispatches them (checkpointing/_src/marks.py)."""
    target = abstract_state(layout)
    marks_lib.compile_marks(target)
    return target


def timed_restores() -> dict[str, list[float]]:
    service = CheckpointService(os.path.join(_ROOT.value, RESTORE_SOURCE), read_only=True, run=RUN)
    targets = {layout: restore_target(layout) for layout in LAYOUTS}

    def one(layout: str) -> dict[str, float]:
        target = targets[layout]
        reset_probes()
        started = time.perf_counter()
        restored = jax.block_until_ready(service.restore(1, target).state)
        seconds = time.perf_counter() - started
        require("restore_fingerprint_check", where="CheckpointService.restore()")
        del restored
        return {"restore": seconds, "fingerprint_check": PROBES["restore_fingerprint_check"].seconds}

    return rounds({f"restore[{layout}]": lambda layout=layout: one(layout) for layout in LAYOUTS})


def rss_save(kind: str) -> dict[str, list[int]]:
    """Peak RSS above the live state during one save + wait (the process's first: nothing warmed)."""
    state = random_state()
    directory = os.path.join(_ROOT.value, RESTORE_SOURCE if kind == "async" else f"rss_{kind}")
    settle()
    before = common.reset_peak_rss()
    save(kind, directory, state)
    extra = common.peak_rss_bytes() - before
    if kind == "orbax":
        shutil.rmtree(directory)
    return {"extra_bytes": [extra]}


def rss_restore() -> dict[str, list[int]]:
    """Peak RSS during one restore, above the state it restores (the process held none before)."""
    service = CheckpointService(os.path.join(_ROOT.value, RESTORE_SOURCE), read_only=True, run=RUN)
    target = restore_target("same")
    settle()
    before = common.reset_peak_rss()
    restored = jax.block_until_ready(service.restore(1, target).state)
    extra = common.peak_rss_bytes() - before - state_bytes(STATE_GIB.value)
    del restored
    return {"extra_bytes": [extra]}


VARIANTS = {
    "saves": timed_saves,  # sync_save, async_save, orbax_save, orbax_two_items_save
    "passes": passes,  # state_read, fingerprint_pass
    "restores": timed_restores,  # restore[same], restore[data=8], restore[model=8]
    "rss_service_save": lambda: rss_save("async"),  # also writes the restore source
    "rss_orbax_save": lambda: rss_save("orbax"),
    "rss_restore": rss_restore,
}


def main(argv):
    del argv
    if jax.device_count() != 8:
        raise ValueError(f"expected 8 fake CPU devices, got {jax.device_count()}: "
                         "run it through benchmarks.checkpoint_bench")
    print(json.dumps({**VARIANTS[_VARIANT.value](), "state_bytes": [state_bytes(STATE_GIB.value)]}))


if __name__ == "__main__":
    entry.run(main)
