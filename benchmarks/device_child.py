"""The device benchmark's checkpoint part for one state size, in a process of its own (benchmarks/device_bench.py).

  python -m benchmarks.device_child --state_gib=G --root=DIR [--samples=N] [--array_mib=M]

On whatever devices JAX finds (the TPU where there is one), a random float32 state of --state_gib (arrays of
--array_mib, sharded over all devices on one axis) is saved, committed and restored by the service and by plain
Orbax, beside what the machine itself can do with the same bytes:

  device_to_host   every leaf copied to host memory (jax.device_get)
  write_fsync      those host bytes written to one file per leaf, each fsynced, then the directory
  read_back        the same files read back after their pages were dropped (posix_fadvise DONTNEED; a
                   page cache that keeps them anyway makes this a memory read, and the report says which)
  host_to_device   the host copies placed back on the devices
  service_save     CheckpointService.save() with the fingerprints from the step (as the trainer saves at a
                   step-cadence save): save() blocking, then until committed (`total`), and what it blocked in
  orbax_save       ocp.CheckpointManager.save(StandardSave): the same two times
  service_restore  CheckpointService.restore() of the step just saved (its fingerprint check included)
  orbax_restore    ocp.CheckpointManager.restore(StandardRestore) of plain Orbax's step

Each round runs every case once, in an order rotated each round; the first round is not kept. Prints one JSON
line: {"<case>.<value>": [samples], "state_bytes": [n], "platform": ...}.
"""

import collections
import gc
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import CallProbe
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import marking
from checkpointing._src import marks as marks_lib
from checkpointing._src import orbax_hooks
from checkpointing._src import service as service_lib
from checkpointing.config import CheckpointConfig
from checkpointing._src.platform_record import record as platform_record
from checkpointing._src.service import CheckpointService, RunMetadata
from runtime import entry

_STATE_GIB = flags.DEFINE_float("state_gib", 1.0, "Size of the float32 state, GiB.", lower_bound=1 / 1024)
_ARRAY_MIB = flags.DEFINE_integer("array_mib", 128, "Size of each array, MiB.", lower_bound=1)
_ROOT = flags.DEFINE_string("root", None, "The scratch directory.", required=True)
_SAMPLES = flags.DEFINE_integer("samples", 2, "Measured rounds.", lower_bound=1)

# What the service's save() calls while its caller waits (benchmarks/checkpoint_child.py times the same parts).
PARTS = {"check_for_errors": CallProbe(service_lib.CheckpointService, "check_for_errors"),
         "leaf_table": CallProbe(manifest_lib, "leaf_table"),
         "orbax_manager_save": CallProbe(orbax_hooks.Manager, "save")}
COLUMNS = 4096  # a float32 row is 16 KiB: --array_mib * 64 rows, divisible by any device count up to 64


def mesh_sharding() -> NamedSharding:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    return NamedSharding(mesh, P("data"))


def random_state() -> dict:
    sharding = mesh_sharding()
    count = max(1, round(_STATE_GIB.value * 1024 / _ARRAY_MIB.value))
    make = jax.jit(lambda key: jax.random.normal(key, (_ARRAY_MIB.value * 64, COLUMNS), jnp.float32),
                   out_shardings=sharding)
    state = {f"w{i}": make(jax.random.key(i)) for i in range(count)}
    state["step"] = jax.device_put(jnp.int32(0), NamedSharding(sharding.mesh, P()))
    return jax.block_until_ready(state)


def abstract(state: dict) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def timed(run) -> float:
    started = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - started


class Cases:
    """The cases of one state; restores read the saves of the same round (a restore before any save is skipped)."""

    def __init__(self, state: dict, root: str):
        self.state, self.root, self.host = state, root, None
        self.target = abstract(state)
        marks_lib.compile_marks(self.target)  # as Checkpointer.prepare does before a restore
        # The fingerprints a step-cadence save is given, as Checkpointer.on_step dispatches them.
        self.fingerprints = jax.block_until_ready(marking.dispatch(state, fingerprints=True, summaries=False)[0])
        self.run = RunMetadata(config={"bench": True}, fixed_fields={}, fixed_hash="bench",
                               mesh={"data": jax.device_count()})
        self.saved = set()
        # A fresh device copy per case (untimed, as a step makes one): a jax.Array keeps the host copy of its
        # first device_get, so reading the same arrays again would time a memory read, not the transfer.
        self._copy = jax.jit(lambda tree: jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), tree))

    def fresh(self) -> dict:
        return jax.block_until_ready(self._copy(self.state))

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def device_to_host(self) -> dict:
        state = self.fresh()
        started = time.perf_counter()
        self.host = {k: np.asarray(v) for k, v in jax.device_get(state).items()}
        return {"secs": time.perf_counter() - started}

    def write_fsync(self) -> dict:
        host = self.host or {k: np.asarray(v) for k, v in jax.device_get(self.state).items()}
        directory = self._dir("raw")
        shutil.rmtree(directory, ignore_errors=True)
        started = time.perf_counter()
        os.makedirs(directory)
        for name, array in host.items():
            fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(np.ascontiguousarray(array)).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(directory, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        self.saved.add("raw")
        return {"secs": time.perf_counter() - started}

    def read_back(self) -> dict:
        if "raw" not in self.saved:
            return {}
        directory, dropped = self._dir("raw"), 1.0
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                dropped = 0.0
            os.close(fd)
        started = time.perf_counter()
        for name in os.listdir(directory):
            buffer = bytearray(os.path.getsize(os.path.join(directory, name)))
            with open(os.path.join(directory, name), "rb", buffering=0) as f:
                f.readinto(buffer)
        return {"secs": time.perf_counter() - started, "pages_dropped": dropped}

    def host_to_device(self) -> dict:
        host = self.host or {k: np.asarray(v) for k, v in jax.device_get(self.state).items()}
        shardings = {k: v.sharding for k, v in self.state.items()}
        return {"secs": timed(lambda: jax.device_put(host, shardings))}

    def service_save(self) -> dict:
        shutil.rmtree(self._dir("service"), ignore_errors=True)
        service = CheckpointService(self._dir("service"), CheckpointConfig(async_save=True, max_to_keep=2),
                                    run=self.run)
        state = self.fresh()
        for probe in PARTS.values():
            probe.reset()
        started = time.perf_counter()
        service.save(1, state, losses={}, reason="interval", fingerprints=self.fingerprints)
        blocking = time.perf_counter() - started
        for probe in PARTS.values():
            probe.require_called("CheckpointService.save()")
        parts = {f"part:{name}": probe.seconds for name, probe in PARTS.items()}
        service.wait_until_finished()
        total = time.perf_counter() - started
        service.close()
        self.saved.add("service")
        return {"blocking": blocking, "total": total, **parts}

    def orbax_save(self) -> dict:
        shutil.rmtree(self._dir("orbax"), ignore_errors=True)
        manager = ocp.CheckpointManager(self._dir("orbax"))
        state = self.fresh()
        started = time.perf_counter()
        manager.save(1, args=ocp.args.StandardSave(state))
        blocking = time.perf_counter() - started
        manager.wait_until_finished()
        total = time.perf_counter() - started
        manager.close()
        self.saved.add("orbax")
        return {"blocking": blocking, "total": total}

    def service_restore(self) -> dict:
        if "service" not in self.saved:
            return {}
        service = CheckpointService(self._dir("service"), read_only=True, run=self.run)
        return {"secs": timed(lambda: service.restore(1, self.target).state)}

    def orbax_restore(self) -> dict:
        if "orbax" not in self.saved:
            return {}
        manager = ocp.CheckpointManager(self._dir("orbax"))
        secs = timed(lambda: manager.restore(1, args=ocp.args.StandardRestore(self.target)))
        manager.close()
        return {"secs": secs}


CASES = ("device_to_host", "write_fsync", "read_back", "host_to_device", "service_save", "orbax_save",
         "service_restore", "orbax_restore")


def measure() -> dict:
    cases, samples = Cases(random_state(), _ROOT.value), collections.defaultdict(list)
    for round_ in range(_SAMPLES.value + 1):
        shift = round_ % len(CASES)
        for name in CASES[shift:] + CASES[:shift]:
            gc.collect()
            os.sync()  # no case pays for the last one's writes
            for key, value in getattr(cases, name)().items():
                if round_:
                    samples[f"{name}.{key}"].append(value)
    return samples


def main(argv):
    del argv
    samples = measure()
    count = max(1, round(_STATE_GIB.value * 1024 / _ARRAY_MIB.value))
    print(json.dumps({**samples, "state_bytes": [count * _ARRAY_MIB.value * 2**20 + 4],
                      "platform": platform_record()}))


if __name__ == "__main__":
    entry.run(main)
