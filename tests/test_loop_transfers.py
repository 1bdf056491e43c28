"""The loop keeps every loss on device until its log step (big_vision's transfer guard).

Under jax.transfer_guard("disallow") an implicit transfer is an error, not a slowdown: a batch
built on the host, a Python number fed to the step, a loss read with float() (on TPU and GPU).
On CPU JAX never guards a device-to-host copy (a CPU "device" buffer is host memory), so the test
also watches every host read of a loss: each that waits for its step happens in the one pull of a log
(or save) step. The probe recorder reads its window's losses once they are ready (is_ready: the read
waits for nothing), at whichever step boundary that is.
"""

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers
from trainer import loop

STEPS, LOG_EVERY, SAVE_EVERY = 12, 4, 6  # losses pulled at steps 4, 6 (the save), 8 and 12


class LossReads:
    """Which losses were read on the host, and how many steps had been dispatched by then."""

    def __init__(self):
        self.step_of: dict[int, int] = {}  # id(loss array) -> its step
        self._kept = []  # the arrays themselves, so that no id is reused while watched
        self.dispatched = 0
        self.reads: list[tuple[int, int]] = []  # (step of the loss read, steps dispatched at the read)
        self.ready_reads: list[tuple[int, int]] = []  # the same for reads of a loss already computed

    def add(self, step: int, loss) -> None:
        self._kept.append(loss)
        self.step_of[id(loss)] = step
        self.dispatched = step + 1

    def saw(self, array, ready: bool = False) -> None:
        if id(array) in self.step_of:
            (self.ready_reads if ready else self.reads).append((self.step_of[id(array)], self.dispatched))


@pytest.fixture
def loss_reads(monkeypatch) -> LossReads:
    """Watches the loop's losses (LossLog.add) and every host read of a jax.Array's value: float(),
    np.asarray, jax.device_get, .item() and printing all go through the array's `_value` property."""
    reads = LossReads()
    add = loop.LossLog.add

    def add_and_watch(self, step, loss, *scalars):
        reads.add(step, loss)
        add(self, step, loss, *scalars)

    monkeypatch.setattr(loop.LossLog, "add", add_and_watch)
    array_type = type(jnp.zeros(()))
    host_value = array_type._value

    def watched_value(array):
        # A read at a pull counts whether or not its value is ready; any other read must find it ready.
        reads.saw(array, ready=array.is_ready() and _reader() == "probe")
        return host_value.fget(array)

    monkeypatch.setattr(array_type, "_value", property(watched_value))
    probe = jnp.ones(()) * 3  # the spy must see a read, or a JAX change has made this test vacuous
    reads.step_of[id(probe)] = -1
    float(probe)
    assert reads.reads == [(-1, 0)], "JAX no longer reads array values through ._value: update this spy"
    reads.reads.clear()
    return reads


def _reader() -> str:
    """'probe' when the probe recorder is the one reading (it reads its window's losses once ready)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith("probe_recorder.py"):
            return "probe"
        frame = frame.f_back
    return "other"


def test_the_guard_refuses_an_implicit_transfer_on_this_backend():
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        jax.jit(lambda x: x + 1)(np.ones(3, np.float32))


@pytest.mark.slow  # it trains (in this process)
def test_losses_stay_on_device_between_log_steps(tmp_path, loss_reads, caplog):
    caplog.set_level(logging.INFO)  # log records are formatted, as in a real run (a loss in one is a read)
    config = helpers.small_config(str(tmp_path / "run"), steps=STEPS, log_every_steps=LOG_EVERY,
                                  save_every_steps=SAVE_EVERY)
    with jax.transfer_guard("disallow"):
        result = loop.train(config)
    assert sorted(result.losses) == list(range(STEPS))
    pulls = sorted({*range(LOG_EVERY, STEPS + 1, LOG_EVERY), *range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)})
    read_at: dict[int, list[int]] = {}
    for step, dispatched in loss_reads.reads:
        read_at.setdefault(step, []).append(dispatched)
    # Each loss is first read by the first pull after it, and only ever at pulls (the log step's, and the
    # save's for its manifest, which finds the value already on the host): never while the steps between run.
    assert {step: min(at) for step, at in read_at.items()} == {
        step: min(p for p in pulls if p > step) for step in range(STEPS)}, read_at
    assert all(p in pulls and p > step for step, at in read_at.items() for p in at), read_at
    # The probe's reads came after the step that computed each loss, and found it computed.
    assert all(step < dispatched for step, dispatched in loss_reads.ready_reads), loss_reads.ready_reads
