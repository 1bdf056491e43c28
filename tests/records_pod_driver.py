"""One process of a local pod reading record batches: python -m tests.records_pod_driver --pattern=GLOB ...

Prints, as its last stdout line, `RESULT <json>`: the row ranges this process read, how many records and steps
it read, and each step's global batch gathered from all processes (the test compares them).
"""

import json

from absl import app, flags

from runtime import distributed

PATTERN = flags.DEFINE_string("pattern", None, "The records glob.")
MESH = flags.DEFINE_string("mesh", "data=8", "data=D,model=M over all the pod's devices.")
BATCH = flags.DEFINE_integer("batch_size", 8, "Global batch.")
STEPS = flags.DEFINE_integer("steps", 5, "Steps read, from 0.")


def main(argv):
    del argv
    distributed.initialize()
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from trainer import input as data_input

    sizes = dict(dict.fromkeys(("data", "model"), 1), **{k: int(v) for k, v in
                                                          (part.split("=") for part in MESH.value.split(","))})
    mesh = jax.make_mesh((sizes["data"], sizes["model"]), ("data", "model"))
    dataset = data_input.open_records(f"records:{PATTERN.value}", seed=0)
    batches = data_input.RecordBatches(dataset, BATCH.value, NamedSharding(mesh, P("data")), prefetch_steps=1)
    try:
        arrays = [batches(step)["tokens"] for step in range(STEPS.value)]
    finally:
        batches.close()
    gathered = [multihost_utils.process_allgather(a, tiled=True)[:, 0].tolist() for a in arrays]
    result = {"process": jax.process_index(), "ranges": batches.ranges, "steps_read": batches.steps_read,
              "records_read": dataset.records_read, "batches": gathered}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
