"""One process of a local pod using the local tier directly (tests/test_local_tier.py runs it).

  python -m launch.local --num_processes=2 --devices_per_process=4 --module=tests.local_tier_driver -- \
      --local_dir='DIR/{process}' --out=OUT --phase=save|check
  python -m tests.local_tier_driver --local_dir='DIR/{process}' --out=OUT --phase=other_layout  (1 x 8 devices)
  ... --phase=measure --persistent_dir=DIR --size_mb=256   per-save costs of both tiers, same state

The state is a dict of arrays on a (data=2, model=4) mesh, each a pure function of the step, so a
later run knows what every step holds. Each process writes what it saw to OUT/<phase>-<process>.json.
"""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing._src import local_tier
from checkpointing._src import workdir as workdir_lib
from checkpointing.config import CheckpointConfig
from checkpointing.errors import CheckpointError
from checkpointing._src.service import CheckpointService, RunMetadata
from runtime import distributed, entry

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Only when run as a program: the tests import this module's helpers into their own process."""
    flags.DEFINE_string("local_dir", None, "Local directory template ('{process}' expanded).", required=True)
    flags.DEFINE_string("out", None, "Where each process writes <phase>-<process>.json.", required=True)
    flags.DEFINE_enum("phase", None, ["save", "check", "other_layout", "measure"], "What to do.", required=True)
    flags.DEFINE_string("persistent_dir", None, "--phase=measure: the persistent tier's workdir.")
    flags.DEFINE_integer("size_mb", 1, "--phase=measure: state size.")

STEPS = (1, 2, 3, 4)
# Replicated, split over one axis (so replicated over the other), split over both, a scalar.
SPECS = {"bias": P(), "kernel": P(None, "model"), "rows": P("data", None), "both": P("data", "model"), "step": P()}


def make_mesh(shape=(2, 4)):
    return jax.make_mesh(shape, ("data", "model"))


def make_state(mesh, step: int, rows: int = 16):
    """Every leaf a pure function of `step`, placed with SPECS on `mesh`."""
    key = jax.random.fold_in(jax.random.key(0), step)
    state = {name: jax.random.normal(jax.random.fold_in(key, i), (rows, 32), jnp.float32)
             for i, name in enumerate(SPECS) if name != "step"}
    state["step"] = jnp.int32(step)
    return {name: jax.device_put(leaf, NamedSharding(mesh, SPECS[name])) for name, leaf in state.items()}


def abstract(mesh):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), make_state(mesh, 0))


def shards_equal(actual, expected) -> bool:
    """Every shard this process holds (replicas included) equals the expected one bit for bit."""
    for name in expected:
        if actual[name].dtype != expected[name].dtype or actual[name].shape != expected[name].shape:
            return False
        want = {shard.device: np.asarray(shard.data) for shard in expected[name].addressable_shards}
        if not all(np.array_equal(np.asarray(s.data), want[s.device]) for s in actual[name].addressable_shards):
            return False
    return True


def run_metadata(mesh) -> RunMetadata:
    return RunMetadata(config={"driver": "local_tier"}, fixed_fields={}, fixed_hash="driver", mesh=dict(mesh.shape))


def open_local(template: str, mesh) -> CheckpointService:
    directory = workdir_lib.expand_local_dir(template, jax.process_index())
    return CheckpointService(directory, CheckpointConfig(max_to_keep=10), run=run_metadata(mesh), tier="local")


def restore_outcome(service, step: int, mesh) -> dict:
    """{"equal": ...} after restoring `step`, or {"error": class name, "message": ...}."""
    try:
        restored = service.restore(step, abstract(mesh))
    except CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"step": step, "equal": shards_equal(restored.state, make_state(mesh, step))}


def save_phase(mesh) -> dict:
    service = open_local(FLAGS.local_dir, mesh)
    for step in STEPS:
        service.save(step, make_state(mesh, step), losses={step: float(step)}, reason="interval")
    service.close()
    return {"committed": service.committed_steps()}


def check_phase(mesh) -> dict:
    service = open_local(FLAGS.local_dir, mesh)
    seen = {"own": service.committed_steps(), "complete": local_tier.complete_local_steps(service)}
    seen["newest"] = restore_outcome(service, seen["complete"][-1], mesh)
    # One host loses its newest copy (a replaced disk): that step is no longer complete anywhere.
    if jax.process_index() == 1:
        shutil.rmtree(workdir_lib.step_dir(service.directory, seen["complete"][-1]))
    multihost_utils.sync_global_devices("local_tier_driver: deleted")
    seen["complete_after_delete"] = local_tier.complete_local_steps(service)
    seen["after_delete"] = restore_outcome(service, seen["complete_after_delete"][-1], mesh)
    # Damage the test did to process 1's copies only: every process must raise, none may go on alone.
    seen["flipped"] = restore_outcome(service, 2, mesh)  # a byte of a replicated leaf's chunk
    seen["truncated"] = restore_outcome(service, 1, mesh)  # its data files cut short
    seen["other_mesh"] = restore_outcome(service, 3, make_mesh((4, 2)))
    service.close()
    return seen


def other_layout_phase() -> dict:
    """One process with all 8 devices, on the saved mesh shape, reading process 0's directory."""
    service = open_local(FLAGS.local_dir, make_mesh())
    return {"complete": local_tier.complete_local_steps(service), "restore": restore_outcome(service, 3, make_mesh())}


def measure_phase(mesh) -> dict:
    """Blocking (save() returns) and total (committed) seconds per save, local vs persistent, same state."""
    rows = max(16, FLAGS.size_mb * 2**20 // (4 * 32 * (len(SPECS) - 1)) // 8 * 8)
    state = make_state(mesh, 1, rows)
    services = {"local": open_local(FLAGS.local_dir, mesh),
                "persistent": CheckpointService(FLAGS.persistent_dir, CheckpointConfig(max_to_keep=2),
                                                run=run_metadata(mesh))}
    times = {tier: [] for tier in services}
    for step in range(1, 7):  # the first save of each tier compiles and allocates: read the rest
        for tier, service in services.items():
            multihost_utils.sync_global_devices(f"measure {tier} {step}")
            started = time.perf_counter()
            service.save(step, state, losses={step: 1.0}, reason="interval")
            blocking = time.perf_counter() - started
            service.wait_until_finished()
            times[tier].append({"blocking_secs": blocking, "total_secs": time.perf_counter() - started})
    for service in services.values():
        service.close()
    return {"state_mb": sum(leaf.nbytes for leaf in state.values()) / 2**20, "times": times}


def main(argv) -> None:
    distributed.initialize()
    mesh = make_mesh()
    phases = {"save": lambda: save_phase(mesh), "check": lambda: check_phase(mesh),
              "other_layout": other_layout_phase, "measure": lambda: measure_phase(mesh)}
    seen = phases[FLAGS.phase]()
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, f"{FLAGS.phase}-{jax.process_index()}.json"), "w") as f:
        json.dump(seen, f, indent=1)


if __name__ == "__main__":
    define_flags()
    entry.run(main)
