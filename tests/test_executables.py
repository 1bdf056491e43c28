"""Kept executables (checkpointing/_src/executables.py): a relaunch loads the save marks' fingerprints from local
disk instead of tracing, lowering and compiling them, and what it loads computes what a compile does, leaf
by leaf. A file that is torn, foreign or for another layout is never loaded. Each launch is a fresh process,
as a relaunch is."""

import json
import os

import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # each launch is a Python subprocess

# One launch: compile_marks (Checkpointer.prepare) for a state of `rows` rows (or `{rows}` as given), then the whole
# {path: fingerprint} dict from the loaded/compiled executable and from the separate fingerprint pass.
LAUNCH = """
import json, sys
import jax, jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marks as marks_lib
cache, rows = sys.argv[1], int(sys.argv[2])
if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
mesh = jax.make_mesh((2, 2), ("data", "model"))
w = jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8) / 7.0
class State(struct.PyTreeNode):  # as a TrainState: a function (a new address each launch) in its static part
    params: dict
    step: jax.Array
    apply_fn: object = struct.field(pytree_node=False)
state = State({"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
               "half": jax.device_put(w.astype(jnp.bfloat16) - 1, NamedSharding(mesh, P(None, "model")))},
              jax.device_put(jnp.int32(rows), NamedSharding(mesh, P())), lambda x: x)
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
source = marks_lib.compile_marks(abstract)  # what Checkpointer.prepare compiles or loads
marks = marks_lib.marks_fn(jax.tree.map(lambda x: x.sharding, state))
assert marks.compiled is not None
print(json.dumps({"source": source, "marks": marks_lib.fingerprints_of(state),
                  "pass": fingerprint_lib.fingerprint_tree(state)}))
"""


def launch(cache: str, rows: int = 64) -> dict:
    result = helpers.run_python(LAUNCH.replace("sys.argv[1], int(sys.argv[2])", f"{cache!r}, {rows}"),
                                device_count=4)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["marks"] == out["pass"] and len(out["marks"]) == 3, out  # every leaf, whichever executable ran
    out["stderr"] = result.stderr
    return out


def kept(cache) -> dict[str, bytes]:
    where = os.path.join(cache, "executables")
    return {name: open(os.path.join(where, name), "rb").read() for name in sorted(os.listdir(where))}


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return cache, launch(cache)


def test_a_relaunch_loads_the_fingerprints_it_compiled_and_they_compute_the_same(first_launch):
    cache, first = first_launch
    assert first["source"] == "compiled"
    files = kept(cache)
    assert len(files) == 1 and next(iter(files)).startswith("marks-fingerprints-"), files
    second = launch(cache)
    assert second["source"] == "disk"
    assert second["marks"] == first["marks"]  # the same values as the launch that compiled them
    assert kept(cache) == files  # nothing written again


def test_another_layout_compiles_its_own_and_leaves_the_first(first_launch, tmp_path):
    cache, first = first_launch
    before = kept(cache)
    other = launch(cache, rows=128)
    assert other["source"] == "compiled" and other["marks"] != first["marks"]
    after = kept(cache)
    assert len(after) == 2 and {k: after[k] for k in before} == before
    assert launch(cache, rows=128)["source"] == "disk"


@pytest.mark.parametrize("damage", ["torn", "foreign"])
def test_a_damaged_file_is_one_warning_and_a_compile_never_a_load(tmp_path, damage):
    cache = str(tmp_path / "cache")
    expected = launch(cache)["marks"]
    (name, data), = kept(cache).items()
    path = os.path.join(cache, "executables", name)
    # torn: the write stopped partway (the digest does not match); foreign: not one of ours at all
    damaged = data[:len(data) // 2] if damage == "torn" else b"\x80not an executable" * 9
    with open(path, "wb") as f:
        f.write(damaged)
    again = launch(cache)
    assert again["source"] == "compiled" and again["marks"] == expected
    assert again["stderr"].count("cannot be loaded") == 1, again["stderr"][-3000:]
    assert list(kept(cache)) == [name] and kept(cache)[name] != damaged  # rewritten in place, whole:
    assert launch(cache)["source"] == "disk"  # the next launch loads it


def test_without_a_cache_directory_nothing_is_kept():
    assert [launch("")["source"] for _ in range(2)] == ["compiled", "compiled"]
