"""The replay protocol: what the verifier needs from a run to prove its checkpoints.

A run names its program in every manifest ("package.module:factory", the Checkpointer's `program`).
The verifier imports the factory and calls it with the config the manifest recorded and the
verifier's own mesh (axes 'data' and 'model'); it returns an object with:

    mesh            the mesh it was built on
    abstract_state  the state as ShapeDtypeStructs with this mesh's shardings (the restore target)
    state_shardings the same tree of NamedShardings
    init_fn()       the run's initial state (the seed's), on those shardings
    step_fn(state, batch) -> (state, loss)   one pure step (it may donate `state`)
    batch_fn(step)  the global batch of `step`: a pure function of (the config, step)
    loss_rtol       largest relative difference of a loss across layouts (measured)
    state_rtol      the per-leaf state tolerance across layouts (verifier/tolerances.py)

trainer.program.Program is one; examples/own_loop.py builds its own. Manifests from before the
field was recorded name the trainer's.
"""

import importlib

import jax

from runtime.dispatch import blocks_each_step

TRAINER_PROGRAM = "trainer.program:replay_program"
REQUIRED = ("mesh", "abstract_state", "state_shardings", "init_fn", "step_fn", "batch_fn", "loss_rtol", "state_rtol")


class ProgramError(ValueError):
    """A manifest's program cannot be built here: its factory, or the config it recorded."""


def load(manifest: dict, mesh):
    """The replay program of the run that saved `manifest`, on `mesh`; ProgramError names what failed."""
    reference = manifest.get("program", TRAINER_PROGRAM)
    module_name, _, attribute = reference.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except Exception as err:  # a user's module: whatever its import raises names the program
        raise ProgramError(f"program {reference}: cannot import it ({type(err).__name__}: {err})") from None
    try:
        program = factory(manifest["config"], mesh)
    except Exception as err:  # the recorded config is the run's; anything it makes the factory raise is named
        raise ProgramError(f"program {reference}: cannot build it from the recorded config "
                           f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    missing = [name for name in REQUIRED if not hasattr(program, name)]
    if missing:
        raise ProgramError(f"program {reference}: its factory's result has no {', '.join(missing)}")
    return program


def replay_losses(program, state, start_step: int, num_steps: int):
    """Runs `num_steps` steps from `state` (at `start_step`); returns (state, {step: loss})."""
    losses = []
    for step in range(start_step, start_step + num_steps):
        state, loss = program.step_fn(state, program.batch_fn(step))
        losses.append(loss)
        if blocks_each_step(program.mesh):
            loss.block_until_ready()
    values = jax.device_get(losses)
    return state, {start_step + i: float(v) for i, v in enumerate(values)}
