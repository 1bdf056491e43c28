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

and, optionally, `code`: the identity of the code it replays with (for the trainer: version, spec
module and source hash, git commit; trainer/code.py), compared with the `config["code"]` each
manifest recorded: a step computed by other code is never called reproduced (code_change below).
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


CODE_FIELDS = ("version", "spec_module", "spec_sha256", "git_commit")  # not git_dirty: any edit flips it


def code_change(program, manifests: list[dict]) -> str | None:
    """What differs between the code that recorded `manifests` and the code `program` replays with,
    as 'step S: name old -> new, ...', or None (the same code, or either side records none)."""
    current = getattr(program, "code", None)
    for manifest in manifests:
        recorded = (manifest.get("config") or {}).get("code")
        if not (current and isinstance(recorded, dict)):
            continue
        changed = [f"{name} {str(recorded.get(name))[:12]} -> {str(current.get(name))[:12]}" for name in CODE_FIELDS
                   if recorded.get(name) != current.get(name)]
        if changed:
            return f"step {manifest['step']}: {', '.join(changed)}"
    return None


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
