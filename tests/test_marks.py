"""Save marks (checkpointing/_src/marks.py): on_step dispatches a state's fingerprints and probe summaries at the
steps a save or a probe is certain (checkpointing/_src/marking.py), and a save then dispatches no pass of its own.
Compared leaf by leaf with the separate passes; the steps marked are compared as whole lists; the loops' steps
are checked through the manifests and probes they wrote."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing import CheckpointConfig, Checkpointer, Preempted
from checkpointing.errors import FingerprintMismatchError
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import marking
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
    return new, jnp.sum(new["w"]), marks_lib.step_marks(new, flags, SHARDINGS)


STEP = jax.jit(_step, out_shardings=(SHARDINGS, REPLICATED, (REPLICATED, REPLICATED)))
PLAIN_STEP = jax.jit(lambda state: _step(state, marks_lib.request(MESH).flags)[:2],
                     out_shardings=(SHARDINGS, REPLICATED))  # a user's step: no marks


def test_a_steps_marks_equal_the_separate_passes_leaf_by_leaf_and_are_zero_when_not_asked():
    state, _, marks = STEP(state_at(3), marks_lib.request(MESH, fingerprints=True, summaries=True).flags)
    paths = marks_lib.leaf_paths(state)
    assert marks_lib.fingerprint_ints(marks[0], paths) == fingerprint_lib.fingerprint_tree(state)
    separate, in_step = probes.to_host(probes.leaf_summaries(state)), marks_lib.summaries_of(marks[1], paths)
    assert sorted(in_step) == sorted(separate) == sorted(paths)
    for path in paths:  # two reductions in different executables: equal up to float32 rounding
        np.testing.assert_allclose(in_step[path], separate[path], rtol=1e-6)
    state, _, marks = STEP(state, marks_lib.request(MESH).flags)
    assert not np.any(np.asarray(marks[0])) and not np.any(np.asarray(marks[1]))


def test_marks_fn_dispatches_only_the_parts_asked_and_equals_the_separate_passes():
    """on_step's marks (marks_fn: one executable per part, dispatched after the step) are the same values as
    step_marks' in a caller's jit and the separate passes; a part not asked is not computed."""
    state = STEP(state_at(3), marks_lib.request(MESH).flags)[0]
    fn = marks_lib.marks_fn(SHARDINGS)
    assert fn is marks_lib.marks_fn(dict(SHARDINGS)), "one object per layout: its callers share its executables"
    fingerprints, summaries = fn(state, marks_lib.request(MESH, fingerprints=True, summaries=True))
    in_jit = jax.jit(lambda s, f: marks_lib.step_marks(s, f, SHARDINGS))(
        state, marks_lib.request(MESH, True, True).flags)
    paths = marks_lib.leaf_paths(state)
    assert marks_lib.fingerprint_ints(fingerprints, paths) == fingerprint_lib.fingerprint_tree(state) == \
        marks_lib.fingerprint_ints(in_jit[0], paths)
    separate = probes.to_host(probes.leaf_summaries(state))
    mine, theirs = marks_lib.summaries_of(summaries, paths), marks_lib.summaries_of(in_jit[1], paths)
    assert sorted(mine) == sorted(separate) == sorted(paths)
    for path in paths:
        np.testing.assert_allclose(mine[path], separate[path], rtol=1e-6)
        np.testing.assert_allclose(mine[path], theirs[path], rtol=1e-6)
    assert fn(state, marks_lib.request(MESH, fingerprints=True))[1] is None
    assert fn(state, marks_lib.request(MESH, summaries=True))[0] is None


def _abstract(state) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _open(workdir, total_steps, mesh=MESH, **options) -> Checkpointer:
    return Checkpointer(workdir, CheckpointConfig(max_to_keep=100, **options), config={"lr": 0.1}, fixed=["lr"],
                        mesh=mesh, total_steps=total_steps, program="tests.test_marks:none", watchdog_secs=600)


def _train(workdir, total_steps, counted, *, preempt_after=None, prepare=False, **options):
    """A user's loop on the public API; returns [(step, fingerprints dispatched, summaries dispatched)]."""
    marked = []
    with _open(workdir, total_steps, **options) as ckpt:
        if prepare:
            assert ckpt.prepare(_abstract(state_at(0))).result() in ("compiled", "disk")
        start = ckpt.restore_or_init(_abstract(state_at(0)), lambda: state_at(0))
        assert marks_lib.compiled_for(start.state) or not prepare, "the restored state's layout is not the compiled one"
        state = start.state
        for step in range(start.step, total_steps):
            state, loss = PLAIN_STEP(state)
            if step == preempt_after:
                os.kill(os.getpid(), signal.SIGTERM)  # read at this step's on_step: saved, then Preempted
            before, calls = counted["calls"], len(counted["marks"])
            try:
                ckpt.on_step(step + 1, state, loss)
            finally:  # a preemption's on_step raises once its save committed
                assert len(counted["marks"]) == calls + 1, "on_step did not decide the step's marks once"
                marked.append((step + 1, *counted["marks"][-1]))
                counted["passes"].append(counted["calls"] - before)
    return marked


@pytest.fixture
def counted(monkeypatch):
    """Counts the fingerprint passes a save dispatches itself, and records the marks on_step dispatched."""
    calls = {"calls": 0, "marks": [], "passes": []}
    original, dispatch = fingerprint_lib.tree_fingerprints, marking.dispatch

    def counting(tree):
        calls["calls"] += 1
        return original(tree)

    def recording(state, fingerprints, summaries):
        marks = dispatch(state, fingerprints, summaries)
        calls["marks"].append((marks[0] is not None, marks[1] is not None))
        return marks

    monkeypatch.setattr(fingerprint_lib, "tree_fingerprints", counting)
    monkeypatch.setattr(marking, "dispatch", recording)
    return calls


def _check_manifests(workdir):
    for step in committed_steps(workdir):
        leaves = read_manifest(workdir, step)["leaves"]
        assert {path: leaf["fingerprint"] for path, leaf in leaves.items()} == \
            fingerprint_lib.fingerprint_tree(_replayed(step))


def test_on_step_marks_the_steps_it_saves_and_probes_and_the_save_dispatches_no_pass(workdir, counted):
    marked = _train(workdir, 12, counted, save_every_steps=5, probe_steps=2, probe_summaries="device")
    assert [s for s, fingerprints, _ in marked if fingerprints] == [5, 10, 12]
    assert [s for s, _, summaries in marked if summaries] == [7, 12]  # 2 steps after the saves of 5 and 10
    assert counted["passes"] == [0] * 12, "a save given the step's fingerprints dispatched a pass of its own"
    assert committed_steps(workdir) == [5, 10, 12]
    _check_manifests(workdir)
    for step, summary_step in ((5, 7), (10, 12)):
        probe = probes.read(workdir, step)
        assert (probe["summary_pass"], probe["summary_step"]) == (probes.STEP_PASS, summary_step)
        assert probe["summaries"] == marking.summaries_of(_replayed(summary_step)), "not the marks' own numbers"
        separate = probes.to_host(probes.leaf_summaries(_replayed(summary_step)))
        assert sorted(probe["summaries"]) == sorted(separate)
        for path, value in separate.items():
            np.testing.assert_allclose(probe["summaries"][path], value, rtol=1e-6)


def test_a_save_not_known_ahead_takes_its_own_pass(workdir, counted):
    """A preemption's save (as a time-based one) is decided at its step: no marks were dispatched for it."""
    with pytest.raises(Preempted):
        _train(workdir, 10, counted, preempt_after=6, save_every_steps=5)
    assert [step for step, (fingerprints, _) in enumerate(counted["marks"], 1) if fingerprints] == [5]
    assert counted["passes"] == [0, 0, 0, 0, 0, 0, 1], "the preemption's save did not take its own pass"
    assert committed_steps(workdir) == [5, 7]
    _check_manifests(workdir)


def test_a_state_held_in_host_memory_is_summarized_there_and_no_step_is_marked_for_summaries(workdir, counted,
                                                                                             monkeypatch):
    """--probe_summaries=auto (the default) on CPU devices of one process: the probes' summaries are taken on
    the host (checkpointing/_src/probes.py), so on_step never dispatches them and no summary pass runs; the
    values are host_summaries' of the state, and the device pass's up to float32 rounding."""
    dispatched, original = [], probes.leaf_summaries
    monkeypatch.setattr(probes, "leaf_summaries", lambda tree: dispatched.append(tree) or original(tree))
    marked = _train(workdir, 12, counted, save_every_steps=5, probe_steps=2)
    monkeypatch.setattr(probes, "leaf_summaries", original)
    assert [s for s, fingerprints, _ in marked if fingerprints] == [5, 10, 12]
    assert [s for s, _, summaries in marked if summaries] == [] and dispatched == []
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
        state = PLAIN_STEP(state)[0]
    return state


def test_a_prepared_layout_saves_and_checks_restores_through_its_compiled_marks_not_a_pass(workdir, counted,
                                                                                         monkeypatch):
    """Checkpointer.prepare (what the trainer does before its restore): the marks of cadence saves, a
    preemption's save and the restore's check dispatch the compiled marks executable; no pass runs or compiles."""
    monkeypatch.setattr(marks_lib, "_COMPILED", set())  # this test's compile only
    threads = []
    monkeypatch.setattr(fingerprint_lib.CompiledAhead, "__init__", lambda self, tree: threads.append(tree))
    _train(workdir, 15, counted, prepare=True, save_every_steps=5)
    with pytest.raises(Preempted):  # resumed from 15, preempted at 17
        _train(workdir, 20, counted, preempt_after=16, prepare=True, save_every_steps=5)
    _train(workdir, 20, counted, prepare=True, save_every_steps=5)  # resumed from the preemption's 17
    assert counted["calls"] == 0 and threads == [], "a fingerprint pass was dispatched or compiled"
    assert committed_steps(workdir) == [5, 10, 15, 17, 20]
    _check_manifests(workdir)
    manifest = read_manifest(workdir, 20)
    manifest["leaves"]["['cols']"]["fingerprint"] ^= 1
    with pytest.raises(FingerprintMismatchError, match=r"^step 20: leaf \['cols'\] fingerprint"):
        check_fingerprints(20, manifest, _replayed(20))


def test_the_probe_summaries_compile_ahead_on_a_thread_not_at_the_first_probe(workdir):
    """restore_or_init starts the summaries' compile on a thread, so a probe's on_step never compiles them
    through jit (on a TPU that stopped the loop 6-15 s); the probe's summaries equal the separate pass's."""
    # A layout of its own (the devices in reverse): no other test compiled its marks.
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[::-1])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s.spec), SHARDINGS)
    plain_step = jax.jit(lambda s: _step(s, marks_lib.request(MESH).flags)[:2], out_shardings=(shardings, None))
    fn = marks_lib.marks_fn(shardings)
    with _open(workdir, 8, mesh, save_every_steps=5, probe_steps=2, probe_summaries="device") as ckpt:
        first = jax.device_put(state_at(0), shardings)
        state = ckpt.restore_or_init(_abstract(first), lambda: first).state
        for step in range(8):
            state, loss = plain_step(state)
            ckpt.on_step(step + 1, state, loss)
    assert fn.summaries._cache_size() == 0, "the probe's summaries compiled through jit at the probe"
    probe = probes.read(workdir, 5)
    assert (probe["summary_pass"], probe["summary_step"]) == (probes.STEP_PASS, 7)
    separate = probes.to_host(probes.leaf_summaries(jax.device_put(_replayed(7), shardings)))
    assert sorted(probe["summaries"]) == sorted(separate)
    for path, value in separate.items():
        np.testing.assert_allclose(probe["summaries"][path], value, rtol=1e-6)


def test_prepare_starts_the_probe_summaries_compile_beside_the_callers_and_a_kept_compile_waits_for_it(
        workdir, monkeypatch):
    """Checkpointer.prepare starts the summaries' compile (what the trainer calls before compiling its step), so
    it runs beside the step's compile, not after the restore (on a TPU v5e the first probe waited 3.7 s for what
    was left of it); compile_marks' compile, which turns JAX's persistent cache off, waits for it first. A state
    held whole on the host (probes summed there) compiles no summaries."""
    devices = jax.devices()[4:] + jax.devices()[:4]  # a layout no other test compiles
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=devices)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s.spec), SHARDINGS)
    abstract = _abstract(jax.device_put(state_at(0), shardings))
    fn = marks_lib.marks_fn(shardings)
    order = []
    waited = fn.summaries_compiled
    monkeypatch.setattr(fn, "summaries_compiled", lambda: (waited(), order.append("summaries waited")))
    monkeypatch.setattr(marks_lib.executables, "load_or_compile",
                        lambda *args: (order.append("kept compile"), (None, "compiled"))[1])
    with _open(workdir, 8, mesh, save_every_steps=5, probe_steps=2, probe_summaries="device") as ckpt:
        ckpt.prepare(abstract)
        assert fn._summaries_ahead is not None, "prepare did not start the summaries' compile"
        marks_lib.compile_marks(abstract)
        assert fn._summaries_ahead.result() is not None and fn._summaries_ahead.exception() is None
    assert order == ["summaries waited", "kept compile"]
    host = jax.tree.map(lambda s: NamedSharding(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), P()),
                        SHARDINGS)
    with _open(os.path.join(workdir, "host"), 8, host["w"].mesh, save_every_steps=5, probe_steps=2) as ckpt:
        ckpt.prepare(_abstract(jax.device_put(state_at(0), host)))
    assert marks_lib.marks_fn(host)._summaries_ahead is None, "summaries compiled for a state summed on the host"
