"""The checkpoint benchmark's state (benchmarks/checkpoint_child.py measures it): --state_gib of float32 arrays of
--array_mib each, made directly in their shards, and the layouts a save or restore puts them on."""

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

STATE_GIB = flags.DEFINE_float("state_gib", 1.0, "Size of the float32 state, GiB (--array_mib arrays).",
                               lower_bound=1 / 1024)
ARRAY_MIB = flags.DEFINE_integer("array_mib", 128, "Size of each array, MiB.", lower_bound=1)

COLUMNS = 4096  # a row of float32 is 16 KiB: --array_mib * 64 rows, divisible by every layout's axes
# name -> (mesh axis sizes, partition spec of each array) of a state or restore target.
LAYOUTS = {"same": ((4, 2), P("data", "model")),
           "data=8": ((8, 1), P("data", None)),
           "model=8": ((1, 8), P(None, "model"))}


def leaf_shape() -> tuple[int, int]:
    return (ARRAY_MIB.value * 64, COLUMNS)


def num_arrays(state_gib: float) -> int:
    return max(1, round(state_gib * 1024 / ARRAY_MIB.value))


def state_bytes(state_gib: float) -> int:
    return num_arrays(state_gib) * ARRAY_MIB.value * 2**20 + 4


def shardings(layout: str) -> dict:
    mesh_shape, spec = LAYOUTS[layout]
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tree = {f"w{i}": NamedSharding(mesh, spec) for i in range(num_arrays(STATE_GIB.value))}
    tree["step"] = NamedSharding(mesh, P())
    return tree


def random_state() -> dict:
    """Random arrays made directly in their shards (no host copy), fully sharded over data=4,model=2."""
    target = shardings("same")
    make = jax.jit(lambda key: jax.random.normal(key, leaf_shape(), jnp.float32), out_shardings=target["w0"])
    state = {name: make(jax.random.key(i)) for i, name in enumerate(target) if name != "step"}
    state["step"] = jax.device_put(jnp.int32(0), target["step"])
    return jax.block_until_ready(state)


def abstract_state(layout: str) -> dict:
    return {name: jax.ShapeDtypeStruct(() if name == "step" else leaf_shape(),
                                       jnp.int32 if name == "step" else jnp.float32, sharding=sharding)
            for name, sharding in shardings(layout).items()}
