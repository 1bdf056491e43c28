"""python -m trainer.train with its workdir reads counted, for tests/test_workdir_reads.py.

Counts each listing of a checkpoints directory and each manifest read that reaches the storage
(checkpointing/_src/workdir.py's two primitives), and writes the counts to $READS_OUT when the first step
is dispatched: the start-up is over. On gs:// it then asks for the object `<workdir>/startup-over`,
so the server's request log shows where the start-up ended.
"""

import collections
import json
import os

from etils import epath

from checkpointing._src import workdir as workdir_lib
from runtime import entry
from trainer import loop, train

listings, manifests = collections.Counter(), collections.Counter()
_list_committed, _read_manifest = workdir_lib._list_committed, workdir_lib._read_manifest


def counted_listing(directory):
    listings[str(directory)] += 1
    return _list_committed(directory)


def counted_manifest(directory, step):
    manifests[f"{directory}:{step}"] += 1
    return _read_manifest(directory, step)


_run_steps = loop.run_steps


def first_step(program, state, start, *args, **kwargs):
    with open(os.environ["READS_OUT"], "w") as out:
        json.dump({"listings": listings, "manifests": manifests, "start": start}, out)
    workdir = os.environ["READS_WORKDIR"]
    if workdir.startswith("gs://"):
        epath.Path(f"{workdir}/startup-over").exists()
    return _run_steps(program, state, start, *args, **kwargs)


workdir_lib._list_committed, workdir_lib._read_manifest = counted_listing, counted_manifest
loop.run_steps = first_step

if __name__ == "__main__":
    entry.run(train.main)
