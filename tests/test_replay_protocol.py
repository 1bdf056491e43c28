"""The replay protocol (checkpointing.ReplayProgram): the verifier checks a run's program once, at load, and
names every member it lacks; the trainer's program is one."""

import types

import jax
import pytest

from checkpointing import ReplayProgram
from checkpointing._src.replay import missing_members
from tests import helpers
from trainer.program import build_mesh, build_program
from verifier.program import ProgramError, load


def incomplete(config, mesh):
    return types.SimpleNamespace(mesh=mesh, abstract_state={}, step_fn=lambda state, batch: (state, 0.0))


def test_a_program_missing_members_is_refused_at_load_naming_each_one():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ProgramError) as raised:
        load({"program": "tests.test_replay_protocol:incomplete", "config": {}}, mesh)
    assert str(raised.value) == ("program tests.test_replay_protocol:incomplete: its factory's result has no "
                                 "state_shardings, init_fn, batch_fn or batches_from")


def test_the_trainers_program_is_a_replay_program(tmp_path):
    config = helpers.small_config(str(tmp_path / "run"))
    program = build_program(config, build_mesh(config))
    assert missing_members(program) == []
    assert list(ReplayProgram.__annotations__) == ["mesh", "abstract_state", "state_shardings", "init_fn", "step_fn"]
