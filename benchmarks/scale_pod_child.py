"""One process of a real local pod (launch/local.py) counting what a save and a restore cost it.

  python -m launch.local --num_processes=N --devices_per_process=2 --module=benchmarks.scale_pod_child -- \
      --workdir=gs://B/run --out=DIR --emulator_url=URL [--state_mb=8]

Each process runs the public `Checkpointer` as a training loop does, one phase each: open (the
lease on process 0) and restore_or_init (fresh); four steps' on_step (saves at 2 and 4); close;
then a second Checkpointer that restores the newest step. The state is float32, sharded over every
device of the pod, so each process holds 1/N of it. Around each phase every process meets in a
barrier of its own (outside the counts); process 0 reads the GCS-protocol server's request log
there (tests/gcs_emulator.py). Each process counts the multi-host agreements it took part in, by
wrapping (not replacing) the calls that make them: JAX's device collectives (multihost_utils:
broadcast, allgather, barrier), the service's own agreements through the runtime's key-value store
(runtime/collective.py: process 0's answers and barriers), the per-step preemption sync point, and
Orbax's coordination-service barriers. Every process writes DIR/<process>.json; process 0 adds the request log of each
phase.
"""

import collections
import json
import os
import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.multihost import multihost as orbax_multihost

from checkpointing import CheckpointConfig, Checkpointer
from runtime import collective, distributed, entry

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's gs:// workdir.", required=True)
_OUT = flags.DEFINE_string("out", None, "Each process writes <process>.json here.", required=True)
_EMULATOR_URL = flags.DEFINE_string("emulator_url", None, "The GCS-protocol server (its request log).", required=True)
_STATE_MB = flags.DEFINE_integer("state_mb", 8, "Size of the float32 state, MiB.", lower_bound=1)

SAVE_EVERY_STEPS = 2
TOTAL_STEPS = 4  # two saves: steps 2 and 4 (the final one)
AGREEMENTS = collections.Counter()


def _counting(owner, name: str, label: str, *, returns_fn: bool = False) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        if returns_fn:  # Orbax builds a barrier function, then calls it: count the calls
            barrier = original(*args, **kwargs)

            def counted_barrier(*a, **k):
                AGREEMENTS[label] += 1
                return barrier(*a, **k)

            return counted_barrier
        AGREEMENTS[label] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def count_agreements() -> None:
    """Counts every multi-host agreement by kind (orbax's sync_global_processes calls JAX's barrier: one count)."""
    _counting(multihost_utils, "broadcast_one_to_all", "device broadcast")
    _counting(multihost_utils, "process_allgather", "device allgather")
    _counting(multihost_utils, "sync_global_devices", "device barrier")
    _counting(multihost_utils, "reached_preemption_sync_point", "preemption sync point")
    _counting(collective, "_primary_text", "store broadcast")  # what broadcast_ints and broadcast_rows send
    _counting(collective, "_store_barrier", "store barrier")
    _counting(orbax_multihost, "get_barrier_sync_fn", "coordination-service barrier", returns_fn=True)


def make_state(mesh, state_mb: int) -> dict:
    rows = max(mesh.size, state_mb * 2**20 // (4 * 1024) // mesh.size * mesh.size)
    sharding = NamedSharding(mesh, P("data", None))
    # Random, not constant: Orbax compresses chunks, and a constant one would write almost nothing.
    weights = jax.jit(lambda: jax.random.normal(jax.random.key(0), (rows, 1024), jnp.float32),
                      out_shardings=sharding)()
    return {"weights": weights, "step": step_counter(mesh, 0)}


def step_counter(mesh, step: int):
    return jax.device_put(jnp.int32(step), NamedSharding(mesh, P()))


def abstract(state) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def open_checkpointer(mesh) -> Checkpointer:
    options = CheckpointConfig(save_every_steps=SAVE_EVERY_STEPS, max_to_keep=3)
    return Checkpointer(_WORKDIR.value, options, config={"benchmark": "scale_pod"}, fixed=["benchmark"], mesh=mesh,
                        total_steps=TOTAL_STEPS)


class Phases:
    """Per phase: this process's agreements and seconds; on process 0 also the server's request log."""

    def __init__(self):
        self.seen: dict[str, dict] = {}
        self._primary = jax.process_index() == 0

    def run(self, name: str, body) -> None:
        multihost_utils.sync_global_devices(f"scale_pod_child: before {name}")
        if self._primary:
            _request_log(clear=True)
        before, started = AGREEMENTS.copy(), time.perf_counter()
        body()
        secs = time.perf_counter() - started
        agreements = dict(AGREEMENTS - before)
        multihost_utils.sync_global_devices(f"scale_pod_child: after {name}")
        self.seen[name] = {"secs": secs, "agreements": agreements}
        if self._primary:  # every process has finished the phase: the log holds all of its requests
            self.seen[name]["requests"] = _request_log(clear=True)


def _request_log(clear: bool) -> list[dict]:
    from tests import gcs_emulator  # benchmarks may use the tests' server helpers

    return gcs_emulator.request_log(_EMULATOR_URL.value, clear=clear)


def main(argv) -> None:
    del argv
    distributed.initialize()
    count_agreements()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    state = make_state(mesh, _STATE_MB.value)
    phases, opened = Phases(), {}

    def open_fresh() -> None:
        ckpt = opened["trainer"] = open_checkpointer(mesh)
        opened["state"] = ckpt.restore_or_init(abstract(state), lambda: state).state

    def save_twice() -> None:  # on_step at every step, as a loop calls it; saves at 2 and 4 (async)
        current = opened["state"]
        for step in range(1, TOTAL_STEPS + 1):
            current = {"weights": current["weights"], "step": step_counter(mesh, step)}
            opened["trainer"].on_step(step, current)

    def restore() -> None:
        with open_checkpointer(mesh) as ckpt:
            opened["restored_step"] = ckpt.restore_or_init(abstract(state), lambda: state).step

    phases.run("open (fresh)", open_fresh)
    phases.run("2 saves", save_twice)
    phases.run("close (last commit)", lambda: opened["trainer"].close())
    phases.run("open + restore", restore)
    os.makedirs(_OUT.value, exist_ok=True)
    result = {"process": jax.process_index(), "processes": jax.process_count(),
              "restored_step": opened["restored_step"],
              "state_bytes": sum(leaf.nbytes for leaf in state.values()), "saves": TOTAL_STEPS // SAVE_EVERY_STEPS,
              "phases": phases.seen}
    with open(os.path.join(_OUT.value, f"{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    entry.run(main)
