"""What every proof of the verifier shares, handed to each owner explicitly (verifier/proofs.py's StepProver,
verifier/chain_proof.py's ChainProver): its options, its own mesh, the run's replay programs on it and on its
other layouts, the run's identity, the read-only service, the budget of full proofs, and the replay function
(verifier/verifier.py passes its own: new commits proved intact and SIGTERM checked between chunks).
"""

import dataclasses
from typing import Callable

from absl import logging

from checkpointing.verification import CheckpointService
from checkpointing.verification import committed_steps
from runtime import mesh as mesh_lib
from verifier import identity
from verifier import layouts
from verifier import program as program_lib
from verifier import tolerances as tolerances_lib
from verifier.budget import ProofBudget


@dataclasses.dataclass(frozen=True)
class VerifierOptions:
    workdir: str  # the trainer's workdir (local path or gs://)
    mesh: tuple[tuple[str, int], ...] = ()  # the verifier's own mesh; () means data=<its devices>
    replay_steps: int = 100  # a proof replays at most this many steps (beyond: the weaker 'replayed')
    verify_budget: float = 1.0  # the full proofs' compute as a fraction of the training's (verifier/budget.py)
    follow: bool = False  # --follow: a save whose probe the trainer is still to record waits for it
    poll_secs: float = 1.0  # first wait between directory polls in --follow
    max_poll_secs: float = 30.0  # polls back off (x2 when nothing new) up to this
    # --tolerances: a calibrate file's rtols in place of every program's own (None: the programs')
    tolerances: tolerances_lib.Measured | None = None
    # --measure_noise: replay across layouts again on the verifier's other layouts (verifier/evidence.py); off,
    # a proof across layouts rests on the bounds the program declares (one replay: half the compute)
    measure_noise: bool = True
    reverify: tuple[int, ...] | str = ()  # --reverify: steps whose complete verdicts are redone, or "all"


class ProofContext:
    """One per verifier: the mesh, programs and run identity are found once and kept for every proof."""

    def __init__(self, options: VerifierOptions, replay: Callable):
        self.options = options
        # replay(program, state, start_step, count, batches) -> (state, {step: loss}): every replay of every proof
        self.replay = replay
        self.service = CheckpointService(options.workdir, read_only=True)
        self.budget = ProofBudget(options.verify_budget)  # the cheap proof spends none; the chain's replays do
        self.programs: dict[tuple, object] = {}  # (program, fixed_hash, mesh shape) -> the replay program
        self._mesh = None
        self._run: dict | None = None  # the run's identity (verifier/identity.py)

    def mesh(self):
        """The verifier's own mesh: --mesh over the first devices it needs (data=<all devices> by default).
        Its other layouts (verifier/layouts.py) are built over this mesh's devices, so they stay in the subset."""
        if self._mesh is None:
            self._mesh = mesh_lib.build(self.options.mesh, mesh_lib.first_devices(self.options.mesh))
        return self._mesh

    def mesh_shape(self) -> dict:
        return dict(self.mesh().shape)

    def run_manifest(self) -> dict | None:
        """The run's identity (verifier/identity.py run_identity: its fixed config, program and init_from),
        found once and kept: a retention that deletes steps later does not change which run the workdir holds."""
        if self._run is None:
            self._run = identity.run_identity(self.options.workdir, committed_steps(self.options.workdir))
        return self._run

    def program_for(self, manifest: dict, mesh=None):
        """The run's replay program on the verifier's mesh, or on `mesh` (one of its other layouts)."""
        mesh = mesh or self.mesh()
        key = (manifest.get("program"), manifest["fixed_hash"], tuple(mesh.shape.items()))
        if key not in self.programs:
            measured = self.options.tolerances
            differing = measured.differences(manifest.get("config") or {}) if measured is not None else []
            if differing and mesh is self.mesh():  # the user's choice stands; a mismatch is worth a line
                logging.warning("--tolerances=%s was measured for another config than this run's (%s differ)",
                                measured.path, ", ".join(differing))
            self.programs[key] = program_lib.with_tolerances(program_lib.load(manifest, mesh), measured)
        return self.programs[key]

    def other_programs(self, manifest: dict):
        """The run's program on each other layout of the verifier's devices it can be built on
        (verifier/layouts.py), lazily: a proof asks for a second, and a third only to confirm evidence."""
        for mesh in layouts.other_meshes(self.mesh()) if self.options.measure_noise else ():
            try:
                yield self.program_for(manifest, mesh)
            except program_lib.ProgramError as err:  # that layout does not suit the run (a batch it cannot split)
                logging.vlog(1, "no replay on %s: %s", dict(mesh.shape), err)
