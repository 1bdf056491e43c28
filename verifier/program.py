"""The replay protocol: what the verifier needs from a run to prove its checkpoints.

A run names its program in every manifest ("package.module:factory", the Checkpointer's `program`).
The verifier imports the factory and calls it with the config the manifest recorded and the
verifier's own mesh (axes 'data' and 'model'); it returns a checkpointing.ReplayProgram (checked here,
at load, by checkpointing/_src/replay.py's missing_members):

    mesh            the mesh it was built on
    abstract_state  the state as ShapeDtypeStructs with this mesh's shardings (the restore target)
    state_shardings the same tree of NamedShardings
    init_fn()       the run's initial state (the seed's), on those shardings
    step_fn(state, batch) -> (state, loss)   one pure step (it may donate `state`)
    batch_fn(step)  the global batch of `step`: a pure function of (the config, step)
    (or, for a run that saved a stateful data iterator in its steps, Checkpointer(data_iterator=),
    batches_from(input_states) in its place: an iterator of the global batches from the position
    the run's processes saved, `input_states` being every process's saved iterator state by
    process index (None for a process at the run's start); the verifier reads them from the step
    it replays from;
    when the iterator has `input_states()`, the states it has reached, a reproduced step's must equal
    the ones it saved, so a wrong saved position fails its own step)

and, optionally: `loss_rtol` and `state_rtol`, relative bounds across layouts that act as floors under
the noise the verifier measures (verifier/evidence.py; none needed), and `init_loss_rtol` and
`init_state_rtol`, the same for an interval replayed from the init; and `code`: the identity of the code
it replays with (for the trainer: the digests of its traced init, step and batch function, with version,
spec source hash and git commit for people; trainer/code.py), compared with the `config["code"]` each
manifest recorded: a step computed by another computation is never called reproduced (code_change
below). The verifier's --tolerances replaces the four rtols (with_tolerances below). The verifier
builds the program on its own mesh and on its other layouts (verifier/layouts.py).
trainer.program.Program is one; examples/own_loop.py builds its own.
Manifests from before the field was recorded name the trainer's.
"""

import importlib

import jax

from checkpointing.verification import compare
from checkpointing.verification import marking
from checkpointing.verification import replay
from checkpointing.errors import CorruptCheckpointError
from checkpointing.verification import read_input_states
from runtime.dispatch import blocks_each_step
from trainer import code as code_lib

TRAINER_PROGRAM = "trainer.program:replay_program"


class ProgramError(ValueError):
    """A manifest's program cannot be built here: its factory, or the config it recorded."""


def load(manifest: dict, mesh):
    """The replay program of the run that saved `manifest`, on `mesh`; ProgramError names what failed."""
    reference = manifest.get("program", TRAINER_PROGRAM)
    if reference is None:  # recorded as null by a Checkpointer opened without one (checkpointing/_src/manifest.py)
        raise ProgramError("the run's Checkpointer was opened without program=: nothing names the factory that "
                           "replays its steps, so none can be proved (pass program=\"package.module:factory\", "
                           "docs/api.md)")
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
    missing = replay.missing_members(program)
    if missing:
        raise ProgramError(f"program {reference}: its factory's result has no {', '.join(missing)}")
    return program


class _Retoleranced:
    """A program with the rtols of a calibrate file in place of its own; everything else is its own."""

    def __init__(self, program, measured):
        self._program = program
        self.loss_rtol, self.state_rtol = measured.loss_rtol, measured.state_rtol
        self.init_loss_rtol, self.init_state_rtol = measured.init_loss_rtol, measured.init_state_rtol

    def __getattr__(self, name):  # only for what is not set above
        if name == "_program":  # not yet set (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._program, name)


def floors(program, from_init: bool) -> tuple[float, float]:
    """(loss, state) relative bounds the program declares, as floors under the measured noise
    (verifier/evidence.py; 0: none). From the init, its init_* pair where it has one."""
    loss, state = getattr(program, "loss_rtol", None) or 0.0, getattr(program, "state_rtol", None) or 0.0
    if from_init:
        loss = getattr(program, "init_loss_rtol", None) or loss
        state = getattr(program, "init_state_rtol", None) or state
    return float(loss), float(state)


def with_tolerances(program, measured):
    """`program` compared with `measured` (verifier/tolerances.py Measured; None: its own rtols)."""
    return program if measured is None else _Retoleranced(program, measured)


def code_change(program, manifests: list[dict]) -> str | None:
    """What differs between the computation that recorded `manifests` and the one `program` replays with, as
    'step S: computation.step 3f2a... -> 9c1b..., git_commit ...', or None: the same computation (whatever
    the commit, version or path), or either side records no code. trainer/code.py `changes` decides: the
    computation digests where both sides record them, else (a manifest from before them) the version, spec
    source and git commit."""
    current = getattr(program, "code", None)
    for manifest in manifests:
        changed = code_lib.changes((manifest.get("config") or {}).get("code"), current)
        if changed:
            return f"step {manifest['step']}: {', '.join(changed)}"
    return None


def announced_change(manifest: dict) -> str:
    """What the resume that saved `manifest` announced had changed (trainer/code.py check_resume records it
    as `changed_from`), '; '-joined; empty if it announced nothing."""
    changed = ((manifest.get("config") or {}).get("code") or {}).get("changed_from")
    return "; ".join(str(item) for item in changed) if isinstance(changed, list) else ""


def announces_code_change(manifest: dict) -> bool:
    """Whether `manifest` is a save of a resume across an announced code change: the first save of new code,
    where a new chain of proofs starts (verifier/chain_proof.py new_chain)."""
    return bool(announced_change(manifest))


def replays_input_state(program) -> bool:
    """Whether `program` replays from saved iterator states (batches_from) rather than the step."""
    return hasattr(program, "batches_from")


def input_states(workdir: str, step: int, program) -> list[dict] | None:
    """The iterator states a replay of `program` from `step` starts at (None: it needs none);
    CorruptCheckpointError when the step holds none or an incomplete set."""
    if not replays_input_state(program):
        return None
    states = read_input_states(workdir, step)
    if states is None:
        raise CorruptCheckpointError(f"step {step} holds no input iterator state, and its program replays from "
                                     "one (batches_from)")
    return states


def batches_at(program, states: list[dict] | None, target: list[dict] | None):
    """The batch iterator a replay from `states` reads (None: the program's batch_fn(step)). From the
    run's start (`states` None) every process of the run starts afresh: as many as saved `target`,
    the states of the step the replay proves (a resume on another process count is refused)."""
    if not replays_input_state(program):
        return None
    return iter(program.batches_from(states if states is not None else [None] * len(target or [None])))


def input_mismatch(batches, saved: list[dict] | None):
    """The first process whose replayed iterator state differs from the one the step saved, as a
    compare.Mismatch (None: equal, or the iterator does not report its states)."""
    if batches is None or not hasattr(batches, "input_states"):
        return None
    reached = list(batches.input_states())
    for index in range(max(len(reached), len(saved or ()))):
        want = saved[index] if index < len(saved or ()) else None
        got = reached[index] if index < len(reached) else None
        if want != got:
            return compare.Mismatch("input", f"process {index}", None, None,
                                    f"the input iterator state of process {index} after the replay is {got}, the step "
                                    f"saved {want}")
    return None


def input_note(batches) -> str:
    """What a passing verdict adds when the replay's input position was compared too."""
    return ", and the input iterator reached the position it saved" if hasattr(batches, "input_states") else ""


def replay_losses(program, state, start_step: int, num_steps: int, batches=None, perturb=None):
    """Runs `num_steps` steps from `state` (at `start_step`), each on `next(batches)` or else on
    program.batch_fn(step), and `perturb(state, step)` after each where given (verifier/perturb.py);
    returns (state, {step: loss})."""
    losses = []
    for step in range(start_step, start_step + num_steps):
        state, loss = program.step_fn(state, next(batches) if batches is not None else program.batch_fn(step))
        if perturb is not None:
            state = perturb(state, step)
        losses.append(loss)
        if blocks_each_step(program.mesh):
            loss.block_until_ready()
    values = jax.device_get(losses)
    return state, {start_step + i: float(v) for i, v in enumerate(values)}


def replay_marked_step(program, state, step: int, batches=None):
    """Runs step `step`, then its output's probe summaries as the trainer's on_step took them, with the save
    marks' own executable (checkpointing/_src/marking.py); returns (state, loss, {key path: [sum, norm]})."""
    state, loss = program.step_fn(state, next(batches) if batches is not None else program.batch_fn(step))
    return state, float(jax.device_get(loss)), marking.summaries_of(state)
