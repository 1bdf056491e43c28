"""Save marks (checkpointing/_src/marks.py): a step computes its output's fingerprints and probe summaries when
the Checkpointer asks, and a save then dispatches no pass of its own. Compared leaf by leaf with the
separate passes; the steps asked for are compared as whole lists; the trainer's steps are checked through
the manifests and probes they wrote."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing import CheckpointConfig, Checkpointer
from checkpointing.errors import FingerprintMismatchError
from checkpointing._src.marks import compile_marks, request as mark_request, step_marks
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marks as marks_lib
from checkpointing._src import probes
from checkpointing._src.checks import check_fingerprints
from checkpointing._src.workdir import committed_steps, read_manifest

MESH = jax.make_mesh((4, 2), ("data", "model"))
SHARDED, REPLICATED = NamedSharding(MESH, P("data", "model")), NamedSharding(MESH, P())
# Every kind of layout a leaf's shards can have: both axes, both on one dimension, one axis (the other
# replicated), none.
FLAT, COLUMNS = NamedSharding(MESH, P(("data", "model"), None)), NamedSharding(MESH, P(None, "model"))


def state_at(step: int) -> dict:
    w = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 7.0 + step
    return {"w": jax.device_put(w, SHARDED), "half": jax.device_put(w.astype(jnp.bfloat16), SHARDED),
            "flat": jax.device_put(w - 3.0, FLAT), "cols": jax.device_put(w.T[:, :6] * -1e-20, COLUMNS),
            "step": jax.device_put(jnp.int32(step), REPLICATED)}


SHARDINGS = {"w": SHARDED, "half": SHARDED, "flat": FLAT, "cols": COLUMNS, "step": REPLICATED}


def _step(state, flags):
    new = {"w": state["w"] * 0.5 + 1.0, "half": state["half"] + 1, "flat": state["flat"] * 2.0,
           "cols": state["cols"] * 0.5, "step": state["step"] + 1}
    return new, jnp.sum(new["w"]), step_marks(new, flags, SHARDINGS)


STEP = jax.jit(_step, out_shardings=(SHARDINGS, REPLICATED, (REPLICATED, REPLICATED)))


def test_a_steps_marks_equal_the_separate_passes_leaf_by_leaf_and_are_zero_when_not_asked():
    state, _, marks = STEP(state_at(3), mark_request(MESH, fingerprints=True, summaries=True).flags)
    paths = marks_lib.leaf_paths(state)
    assert marks_lib.fingerprint_ints(marks[0], paths) == fingerprint_lib.fingerprint_tree(state)
    separate, in_step = probes.to_host(probes.leaf_summaries(state)), marks_lib.summaries_of(marks[1], paths)
    assert sorted(in_step) == sorted(separate) == sorted(paths)
    for path in paths:  # two reductions in different executables: equal up to float32 rounding
        np.testing.assert_allclose(in_step[path], separate[path], rtol=1e-6)
    state, _, marks = STEP(state, mark_request(MESH).flags)
    assert not np.any(np.asarray(marks[0])) and not np.any(np.asarray(marks[1]))


def test_marks_fn_dispatches_only_the_parts_asked_and_equals_the_separate_passes():
    """The trainer's marks (marks_fn: one executable per part, dispatched after the step) are the same
    values as step_marks' in a caller's jit and the separate passes; a part not asked is not computed."""
    state = STEP(state_at(3), mark_request(MESH).flags)[0]
    fn = marks_lib.marks_fn(SHARDINGS)
    assert fn is marks_lib.marks_fn(dict(SHARDINGS)), "one object per layout: its callers share its executables"
    fingerprints, summaries = fn(state, mark_request(MESH, fingerprints=True, summaries=True))
    in_jit = jax.jit(lambda s, f: step_marks(s, f, SHARDINGS))(state, mark_request(MESH, True, True).flags)
    paths = marks_lib.leaf_paths(state)
    assert marks_lib.fingerprint_ints(fingerprints, paths) == fingerprint_lib.fingerprint_tree(state) == \
        marks_lib.fingerprint_ints(in_jit[0], paths)
    separate = probes.to_host(probes.leaf_summaries(state))
    mine, theirs = marks_lib.summaries_of(summaries, paths), marks_lib.summaries_of(in_jit[1], paths)
    assert sorted(mine) == sorted(separate) == sorted(paths)
    for path in paths:
        np.testing.assert_allclose(mine[path], separate[path], rtol=1e-6)
        np.testing.assert_allclose(mine[path], theirs[path], rtol=1e-6)
    assert fn(state, mark_request(MESH, fingerprints=True))[1] is None
    assert fn(state, mark_request(MESH, summaries=True))[0] is None


def _train(workdir, total_steps, counted, *, ask=True, **options):
    """A user's loop on the public API; returns [(step, wanted fingerprints, wanted summaries)]."""
    asked = []
    with Checkpointer(workdir, CheckpointConfig(max_to_keep=100, **options), config={"lr": 0.1}, fixed=["lr"],
                      mesh=MESH, total_steps=total_steps, program="tests.test_marks:none",
                      watchdog_secs=600) as ckpt:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_at(0))
        start = ckpt.restore_or_init(abstract, lambda: state_at(0))
        state = start.state
        for step in range(start.step, total_steps):
            wanted = ckpt.marks_wanted(step + 1) if ask else mark_request(MESH, fingerprints=True, summaries=True)
            asked.append((step + 1, wanted.fingerprints, wanted.summaries))
            state, loss, marks = STEP(state, wanted.flags)
            before = counted["calls"]
            ckpt.on_step(step + 1, state, loss, marks=marks)
            counted.setdefault("passes", []).append(counted["calls"] - before)
    return asked


@pytest.fixture
def counted(monkeypatch):
    """Counts the fingerprint passes a save dispatches itself."""
    calls = {"calls": 0}
    original = fingerprint_lib.tree_fingerprints

    def counting(tree):
        calls["calls"] += 1
        return original(tree)

    monkeypatch.setattr(fingerprint_lib, "tree_fingerprints", counting)
    return calls


def test_the_checkpointer_asks_for_marks_at_the_steps_it_saves_and_probes_and_dispatches_no_pass(workdir, counted):
    asked = _train(workdir, 12, counted, save_every_steps=5, probe_steps=2, probe_summaries="device")
    assert [s for s, fingerprints, _ in asked if fingerprints] == [5, 10, 12]
    assert [s for s, _, summaries in asked if summaries] == [7, 12]  # 2 steps after the saves of 5 and 10
    assert counted["passes"] == [0] * 12, "a save given the step's fingerprints dispatched a pass of its own"
    assert committed_steps(workdir) == [5, 10, 12]
    for step in committed_steps(workdir):
        leaves = read_manifest(workdir, step)["leaves"]
        assert {path: leaf["fingerprint"] for path, leaf in leaves.items()} == \
            fingerprint_lib.fingerprint_tree(_replayed(step))
    for step, summary_step in ((5, 7), (10, 12)):
        probe = probes.read(workdir, step)
        assert (probe["summary_pass"], probe["summary_step"]) == (probes.STEP_PASS, summary_step)
        separate = probes.to_host(probes.leaf_summaries(_replayed(summary_step)))
        assert sorted(probe["summaries"]) == sorted(separate)
        for path, value in separate.items():
            np.testing.assert_allclose(probe["summaries"][path], value, rtol=1e-6)


def test_marks_given_for_a_step_not_asked_are_ignored_and_the_save_takes_its_own_pass(workdir, counted):
    _train(workdir, 10, counted, ask=False, save_every_steps=5, probe_steps=2, probe_summaries="device")
    assert counted["passes"] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1], "the unasked marks were used"
    probe = probes.read(workdir, 5)
    assert probe["summary_pass"] == probes.SEPARATE_PASS
    for step in committed_steps(workdir):
        leaves = read_manifest(workdir, step)["leaves"]
        assert {path: leaf["fingerprint"] for path, leaf in leaves.items()} == \
            fingerprint_lib.fingerprint_tree(_replayed(step))


def test_a_state_held_in_host_memory_is_summarized_there_and_no_step_is_asked_for_summaries(workdir, counted,
                                                                                            monkeypatch):
    """--probe_summaries=auto (the default) on CPU devices of one process: the probes' summaries are taken on
    the host (checkpointing/_src/probes.py), so the loop's marks never compute them and no summary pass runs; the
    values are host_summaries' of the state, and the device pass's up to float32 rounding."""
    dispatched, original = [], probes.leaf_summaries
    monkeypatch.setattr(probes, "leaf_summaries", lambda tree: dispatched.append(tree) or original(tree))
    asked = _train(workdir, 12, counted, save_every_steps=5, probe_steps=2)
    monkeypatch.setattr(probes, "leaf_summaries", original)
    assert [s for s, fingerprints, _ in asked if fingerprints] == [5, 10, 12]
    assert [s for s, _, summaries in asked if summaries] == [] and dispatched == []
    for step, summary_step in ((5, 7), (10, 12)):
        probe = probes.read(workdir, step)
        assert (probe["summary_pass"], probe["summary_step"]) == (probes.HOST_PASS, summary_step)
        assert probe["summaries"] == probes.host_summaries(_replayed(summary_step))
        on_device = probes.to_host(probes.leaf_summaries(_replayed(summary_step)))
        assert sorted(probe["summaries"]) == sorted(on_device)
        for path, value in on_device.items():
            np.testing.assert_allclose(probe["summaries"][path], value, rtol=1e-6)


def _replayed(step: int) -> dict:
    state = state_at(0)
    for _ in range(step):
        state = STEP(state, mark_request(MESH).flags)[0]
    return state


def test_a_layout_whose_marks_are_compiled_saves_and_checks_restores_through_them_not_a_pass(workdir, counted,
                                                                                           monkeypatch):
    """compile_marks (what the trainer does before its restore): unasked saves (here every save: the loop
    gives no marks) and the restore's check dispatch the marks executable; no pass runs or compiles."""
    monkeypatch.setattr(marks_lib, "_COMPILED", set())  # this test's compile only
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_at(0))
    threads = []
    monkeypatch.setattr(fingerprint_lib.CompiledAhead, "__init__", lambda self, tree: threads.append(tree))
    compile_marks(abstract)

    def run(total_steps):
        with Checkpointer(workdir, CheckpointConfig(max_to_keep=100, save_every_steps=5), config={"lr": 0.1},
                          fixed=["lr"], mesh=MESH, total_steps=total_steps, program="tests.test_marks:none",
                          watchdog_secs=600) as ckpt:
            start = ckpt.restore_or_init(abstract, lambda: state_at(0))
            assert marks_lib.compiled_for(start.state), "the restored state's layout is not the compiled one"
            state = start.state
            for step in range(start.step, total_steps):
                state, loss, _ = STEP(state, mark_request(MESH).flags)
                ckpt.on_step(step + 1, state, loss)
        return start

    run(10)
    assert run(15).step == 10  # resumed: its check passed through the marks
    assert counted["calls"] == 0 and threads == [], "a fingerprint pass was dispatched or compiled"
    assert committed_steps(workdir) == [5, 10, 15]
    for step in committed_steps(workdir):
        leaves = read_manifest(workdir, step)["leaves"]
        assert {path: leaf["fingerprint"] for path, leaf in leaves.items()} == \
            fingerprint_lib.fingerprint_tree(_replayed(step))
    manifest = read_manifest(workdir, 15)
    manifest["leaves"]["['cols']"]["fingerprint"] ^= 1
    with pytest.raises(FingerprintMismatchError, match=r"^step 15: leaf \['cols'\] fingerprint"):
        check_fingerprints(15, manifest, _replayed(15))


def test_a_loop_dispatching_marks_fn_gets_its_probe_summaries_compiled_ahead_not_at_the_first_probe(workdir):
    """The trainer's loop (marks_fn after the step): the Checkpointer starts the summaries' compile at the first
    marks_wanted, on a thread, so a probe's step never compiles them through jit (on a TPU that stopped the loop
    6-15 s); the probe's summaries equal the separate pass's of the same state."""
    # A layout of its own (the devices in reverse): no other test compiled its marks.
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[::-1])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s.spec), SHARDINGS)
    plain_step = jax.jit(lambda s: _step(s, mark_request(MESH).flags)[:2], out_shardings=(shardings, None))
    fn = marks_lib.marks_fn(shardings)
    with Checkpointer(workdir, CheckpointConfig(max_to_keep=100, save_every_steps=5, probe_steps=2,
                                                probe_summaries="device"), config={"lr": 0.1}, fixed=["lr"],
                      mesh=mesh, total_steps=8, program="tests.test_marks:none", watchdog_secs=600) as ckpt:
        first = jax.device_put(state_at(0), shardings)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), first)
        state = ckpt.restore_or_init(abstract, lambda: first).state
        for step in range(8):
            wanted = ckpt.marks_wanted(step + 1)
            state, loss = plain_step(state)
            ckpt.on_step(step + 1, state, loss, marks=fn(state, wanted) if wanted.any else None)
    assert fn.summaries._cache_size() == 0, "the probe's summaries compiled through jit at the probe"
    probe = probes.read(workdir, 5)
    assert (probe["summary_pass"], probe["summary_step"]) == (probes.STEP_PASS, 7)
    separate = probes.to_host(probes.leaf_summaries(jax.device_put(_replayed(7), shardings)))
    assert sorted(probe["summaries"]) == sorted(separate)
    for path, value in separate.items():
        np.testing.assert_allclose(probe["summaries"][path], value, rtol=1e-6)
