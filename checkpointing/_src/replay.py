"""The replay protocol: what a run's program gives the verifier to prove its checkpoints.

A run names its program in every manifest ("package.module:factory", the Checkpointer's `program`); the
verifier calls `factory(config, mesh)` with the config the manifest recorded and a mesh of its own, and the
result must be a ReplayProgram with one of the two batch sources below. verifier/program.py checks it once,
at load, and names every attribute missing (docs/api.md has the whole contract, the optional members too).
"""

from typing import Any, Callable, Protocol


class ReplayProgram(Protocol):
    """A run's program on one mesh. trainer.program.Program is one; examples/own_loop.py builds its own."""

    mesh: Any  # the jax Mesh it was built on
    abstract_state: Any  # the state as ShapeDtypeStructs with this mesh's shardings (the restore target)
    state_shardings: Any  # the same tree of NamedShardings
    init_fn: Callable[[], Any]  # the run's initial state (the seed's), on those shardings
    step_fn: Callable[[Any, Any], tuple[Any, Any]]  # (state, batch) -> (state, loss): one pure step


# One of these: the batches as a pure function of (config, step), or, for a run that saved a stateful data
# iterator in its steps, an iterator of the global batches from every process's saved iterator state.
BATCH_SOURCES = ("batch_fn", "batches_from")


def missing_members(program) -> list[str]:
    """What `program` lacks of the protocol, by name (empty: it is a ReplayProgram)."""
    missing = [name for name in ReplayProgram.__annotations__ if not hasattr(program, name)]
    if not any(hasattr(program, name) for name in BATCH_SOURCES):
        missing.append(" or ".join(BATCH_SOURCES))
    return missing
