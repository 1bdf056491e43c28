"""One process of a 2 x 2 pod (tests/test_marks_pod.py): the save marks' fingerprints of a state whose leaves
are replicated over processes, split over them, or neither, against each leaf's fingerprint computed whole on
one device of this process. Prints one `RESULT <json>` line."""

import json
import sys

import numpy as np
from absl import app

from runtime import distributed


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def main(argv: list[str]) -> None:
    del argv
    distributed.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from checkpointing._src import fingerprint as fingerprint_lib
    from checkpointing._src import marks as marks_lib
    from checkpointing._src import replicas

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))  # 'data' spans the processes
    rng = np.random.default_rng(7)
    leaves = {  # name: (host value, spec)
        "replicated": (rng.standard_normal((64, 32)).astype(np.float32), P()),
        "model_only": (rng.standard_normal((16, 8)).astype(np.float32), P(None, "model")),
        "data_split": (rng.standard_normal((8, 6)).astype(np.float32), P("data")),
        "odd": (rng.standard_normal((3, 5)).astype(np.float32), P()),  # no dimension divides: stays whole
        "bf16": (rng.standard_normal((4, 6)).astype(jnp.bfloat16), P()),
        "step": (np.int32(12), P()),
    }
    state = {name: jax.make_array_from_callback(np.shape(value), NamedSharding(mesh, spec),
                                                lambda index, value=value: np.asarray(value)[index])
             for name, (value, spec) in leaves.items()}
    state["key"] = jax.jit(lambda: jax.random.key(3), out_shardings=NamedSharding(mesh, P()))()  # a typed key
    shardings = jax.tree.map(lambda x: x.sharding, state)
    marks = marks_lib.marks_fn(shardings)
    got = marks_lib.fingerprint_ints(marks.fingerprint(state), marks_lib.leaf_paths(state))
    # Each leaf whole on one device of this process: no split, no collective.
    host = {name: value for name, (value, _) in leaves.items()}
    host["key"] = np.asarray(jax.random.key_data(state["key"]).addressable_data(0))
    alone = jax.local_devices()[0]
    whole = fingerprint_lib.to_ints({name: fingerprint_lib.leaf_fingerprint(jax.device_put(value, alone))
                                     for name, value in host.items()})
    compiled = marks.fingerprints_jit().lower(state).compile()
    program = compiled.as_text()
    # The fingerprint pass split within each process only, as the verifier's (fingerprint.tree_fingerprints).
    within = fingerprint_lib._fingerprint_fn(mesh).lower(state, replicas.spreads(jax.tree.leaves(state))).compile()
    print("RESULT " + json.dumps({"got": {k: str(v) for k, v in got.items()},
                                  "whole": {k: str(v) for k, v in whole.items()},
                                  "all_reduces": program.count(" all-reduce("),
                                  "all_reduce_starts": program.count(" all-reduce-start("),
                                  "flops": _flops(compiled), "flops_within_processes": _flops(within)}))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
