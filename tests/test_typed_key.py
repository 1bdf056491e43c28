"""A typed PRNG key that a model keeps in its state (seed 003: key_data out, wrap_key_data in) saves,
restores and moves on as it would have: the resumed run's losses and final state equal the
uninterrupted run's, the key's words included."""

import numpy as np
import pytest

from tests import helpers
from trainer import loop

MODEL = "tests.model_specs:KEY_IN_STATE"  # its key is split at every step


@pytest.mark.slow  # it trains (in this process)
def test_a_typed_key_in_the_state_round_trips_through_a_resume(tmp_path):
    straight = loop.train(helpers.small_config(str(tmp_path / "straight"), MODEL, steps=10, save_every_steps=5))
    workdir = str(tmp_path / "resumed")
    first = loop.train(helpers.small_config(workdir, MODEL, steps=5, save_every_steps=5))
    resumed = loop.train(helpers.small_config(workdir, MODEL, steps=10, save_every_steps=5))
    assert sorted(resumed.losses) == list(range(5, 10))
    assert {**first.losses, **resumed.losses} == straight.losses  # bit for bit, the same mesh
    key = ".model_state['noise']['key']"
    words = helpers.leaves_by_path(resumed.state)[key]
    assert words.dtype == np.uint32 and words.shape == (2,)
    assert np.array_equal(words, helpers.leaves_by_path(straight.state)[key])
    assert not np.array_equal(words, helpers.leaves_by_path(first.state)[key]), "the key moved on after the resume"
    assert helpers.leaves_equal(resumed.state, straight.state)
    assert list(helpers.leaves_by_path(resumed.state)) == list(helpers.leaves_by_path(straight.state))
