"""One process of a pod agreeing through runtime/collective.py (tests/test_collective.py): prints one
`RESULT <json>` line with what each agreement gave it. The device collectives are disabled, so an
agreement that still went through them fails the process instead of passing."""

import json
import sys
import time

from absl import app

from runtime import distributed


def _no_device_collective(*args, **kwargs):
    raise AssertionError("an agreement went through a device collective")


def main(argv: list[str]) -> None:
    del argv
    distributed.initialize()
    import jax
    from jax.experimental import multihost_utils

    from runtime import collective

    multihost_utils.broadcast_one_to_all = _no_device_collective
    multihost_utils.sync_global_devices = _no_device_collective
    me = jax.process_index()
    result = {"ints": collective.broadcast_ints([10 * me + 1, 10 * me + 2]),
              # each process passes a different number of rows: process 0's are the answer
              "rows": [list(row) for row in collective.broadcast_rows([[me, i] for i in range(3 - min(me, 2))], 2)],
              "no_rows": collective.broadcast_rows([] if me == 0 else [[7, 7]], 2),
              "decided": collective.decided_by_primary(lambda: me == 0)}
    collective.barrier("before the late reader")
    if me == 1:
        result["sleep_started"] = time.time()
        time.sleep(1.0)  # reads the next agreement late: process 0 must still be there to answer
    result["late"] = collective.broadcast_int(42 if me == 0 else 0)
    result["returned_at"] = time.time()
    # Enough agreements to fill two batches of keys: the store keeps only the newest batch's.
    result["many"] = [collective.broadcast_int(i if me == 0 else -1) for i in range(2 * collective.KEYS_PER_BATCH)]
    collective.barrier("after")
    if me == 0:
        result["keys_left"] = [key for key, _ in collective._client().key_value_dir_get("checkpointing/agreement/")]
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
