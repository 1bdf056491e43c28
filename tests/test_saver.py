"""The per-step save decision and the restore precedence, in process, in milliseconds: a real small
service on a real disk, an injected clock and a scripted preemption decision (checkpointing/_src/saver.py,
checkpointing/_src/schedule.py, checkpointing/_src/restore.py through the public Checkpointer)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpointing import CheckpointConfig, Checkpointer, Preempted
from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import service as service_lib
from checkpointing._src.report import recorded_losses
from checkpointing._src.saver import Saver
from checkpointing._src.schedule import SaveSchedule
from checkpointing._src.service import CheckpointService, RunMetadata
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime.watchdog import Watchdog

MESH = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
RUN = RunMetadata.of_run({"lr": 0.1}, ["lr"], dict(MESH.shape))


def state_at(step: int) -> dict:
    return {"w": jnp.full((4,), float(step)), "step": jnp.asarray(step, jnp.int32)}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedPreemption:
    """The runtime's decision, scripted: preempted at `at` (the Saver asks once per step)."""

    def __init__(self, at: int | None = None):
        self.at, self.asked = at, []

    def decide(self, step: int) -> bool:
        self.asked.append(step)
        return step == self.at

    def decided(self, step: int) -> bool:
        return step == self.at


@pytest.fixture
def watchdog():
    dog = Watchdog(600)
    yield dog
    dog.stop()


def make_saver(workdir, watchdog, *, start_step=0, end_step=100, carried=None, preemption=None, clock=None, **options):
    config = CheckpointConfig(max_to_keep=100, **options).validated()
    service = CheckpointService(workdir, config, run=RUN)
    clock = clock or Clock()
    return Saver(service, SaveSchedule(config, clock=clock), start_step=start_step, end_step=end_step,
                 preemption=preemption or ScriptedPreemption(), watchdog=watchdog, carried_losses=carried,
                 clock=clock)


def run(saver, first: int, last: int, clock=None, secs_per_step=1.0) -> list:
    events = []
    for step in range(first, last + 1):
        if clock is not None:
            clock.now += secs_per_step
        events.append(saver.on_step(step, state_at(step), jnp.float32((step - 1) / 100)))  # the loss of step - 1
    return events


def test_a_save_records_the_carried_losses_of_a_local_resume_and_every_loss_since(workdir, watchdog):
    """Resumed from local step 15 (which carried steps 10..14): the persistent save of 20 records 10..19."""
    saver = make_saver(workdir, watchdog, start_step=15, carried={s: s / 100 for s in range(10, 15)},
                       save_every_steps=10)
    run(saver, 16, 20)
    saver.close()
    assert sorted(recorded_losses(workdir)) == list(range(10, 20))
    assert recorded_losses(workdir) == pytest.approx({s: s / 100 for s in range(10, 20)})


def test_the_restored_step_is_never_saved_again(workdir, watchdog):
    """A loop that reports the step it restored (an interval step) gets no save and no error."""
    first = make_saver(workdir, watchdog, save_every_steps=10)
    run(first, 1, 10)
    first.close()
    saver = make_saver(workdir, watchdog, start_step=10, save_every_steps=10)
    event = saver.on_step(10, state_at(10), None)
    assert not event.saved and committed_steps(workdir) == [10]
    events = run(saver, 11, 20)
    saver.close()
    assert [e.step for e in events if e.saved] == [20] and committed_steps(workdir) == [10, 20]


def test_events_say_what_was_saved_why_and_what_committed(workdir, watchdog):
    saver = make_saver(workdir, watchdog, save_every_steps=5, end_step=12)
    events = run(saver, 1, 12)
    saver.close()
    saved = [(e.step, e.reason, e.tier) for e in events if e.saved]
    assert saved == [(5, "interval", "persistent"), (10, "interval", "persistent"), (12, "final", "persistent")]
    assert all(e.blocking_secs >= 0 for e in events) and not any(e.blocking_secs for e in events if not e.saved)
    # Commits land in the background: each is seen once, at a later step boundary or when the next save
    # waits for it (the final save's commit is close()'s).
    assert [s for e in events for s in e.committed] == [5, 10]


def test_time_based_saves_follow_the_injected_clock(workdir, watchdog):
    clock = Clock()
    saver = make_saver(workdir, watchdog, clock=clock, save_every_secs=10.0, end_step=1000)
    events = run(saver, 1, 35, clock=clock)
    saver.close()
    assert [e.step for e in events if e.saved] == [10, 20, 30]
    assert {e.reason for e in events if e.saved} == {"time"}


def test_a_preemption_saves_its_step_waits_for_the_commit_and_exits_75(workdir, watchdog):
    preemption = ScriptedPreemption(at=7)
    saver = make_saver(workdir, watchdog, save_every_steps=5, preemption=preemption)
    with pytest.raises(Preempted) as raised:
        run(saver, 1, 10)
    assert raised.value.code == 75 and raised.value.step == 7
    assert committed_steps(workdir) == [5, 7] and read_manifest(workdir, 7)["reason"] == "preemption"
    assert preemption.asked == list(range(1, 8)), "one decision per step"
    assert sorted(recorded_losses(workdir)) == list(range(0, 7))


def checkpointer(workdir, total_steps=20, **options) -> Checkpointer:
    return Checkpointer(workdir, CheckpointConfig(max_to_keep=100, **options), config={"lr": 0.1}, fixed=["lr"],
                        mesh=MESH, total_steps=total_steps, watchdog_secs=600)


def abstract():
    sharding = jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), state_at(0))


def train(workdir, first, last, **options):
    with checkpointer(workdir, total_steps=last, **options) as ckpt:
        start = ckpt.restore_or_init(abstract(), lambda: state_at(0))
        for step in range(start.step + 1, last + 1):
            ckpt.on_step(step, state_at(step), jnp.float32(step))
        return start


def test_restore_precedence_latest_falls_back_past_a_corrupt_step(workdir):
    train(workdir, 0, 20, save_every_steps=10)
    chunks = [p for p in pathlib.Path(workdir, "checkpoints", "20", "state").rglob("*") if p.is_file()
              and "d" == p.parent.name]  # TensorStore's data files
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(b"damaged")
    with checkpointer(workdir) as ckpt:
        start = ckpt.restore_or_init(abstract(), lambda: state_at(0))
    assert (start.step, start.tier) == (10, "persistent") and start.manifest["step"] == 10
    np.testing.assert_array_equal(np.asarray(start.state["w"]), np.full((4,), 10.0))


def test_a_restore_compiles_its_fingerprint_pass_while_orbax_reads_and_joins_it_before_the_check(workdir, monkeypatch):
    train(workdir, 0, 10, save_every_steps=10)
    made, checked = [], []

    class Recording(fingerprint_lib.CompiledAhead):
        def __init__(self, tree):
            super().__init__(tree)
            self.joined = False
            made.append(self)

        def join(self):
            super().join()
            self.joined = True

    def check(step, manifest, state):
        checked.append([ahead.joined for ahead in made])
        return original_check(step, manifest, state)

    original_check = service_lib.check_fingerprints
    monkeypatch.setattr(fingerprint_lib, "CompiledAhead", Recording)
    monkeypatch.setattr(service_lib, "check_fingerprints", check)
    with checkpointer(workdir) as ckpt:
        start = ckpt.restore_or_init(abstract(), lambda: state_at(0))
    assert start.step == 10 and checked == [[True]], "the check ran before its compile thread was joined"
    assert not made[0]._thread.is_alive()  # a process exiting inside XLA's compiler aborts: none outlives it


def test_restore_precedence_none_and_step_refuse_by_name_and_change_nothing(workdir):
    train(workdir, 0, 20, save_every_steps=10)
    with pytest.raises(ValueError, match="already has committed steps"):
        checkpointer(workdir, resume_from="none")
    with pytest.raises(ValueError, match=r"--resume_from=10: newer steps \[20\]"):
        checkpointer(workdir, resume_from="10")
    with pytest.raises(ValueError, match="--resume_from=15: not a committed step"):
        checkpointer(workdir, resume_from="15")
    with pytest.raises(ValueError, match="lr: checkpoint 0.1 vs this run 0.2"):
        Checkpointer(workdir, CheckpointConfig(), config={"lr": 0.2}, fixed=["lr"], mesh=MESH, total_steps=20)
    assert committed_steps(workdir) == [10, 20]
    with checkpointer(workdir, resume_from="20") as ckpt:  # the lease was released by every refusal
        assert ckpt.restore_or_init(abstract(), lambda: state_at(0)).step == 20
