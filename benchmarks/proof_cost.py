"""What a proof costs in replayed steps per trainer step: a run trained here and proved by the verifier whose
code is first on the path, every step it replays counted (verifier/program.py's replay_losses and
replay_marked_step, the only ways a proof runs a step), the cheap proof's apart.

It imports only what the verifier has had since before its bound was measured by perturbed replays (6c37b9d), so
one command measures both sides:

  git archive 6c37b9d | tar -x -C /tmp/before
  PYTHONPATH=/tmp/before .venv/bin/python benchmarks/proof_cost.py --verifier_mesh=data=2    # before
  PYTHONPATH=. .venv/bin/python benchmarks/proof_cost.py --verifier_mesh=data=2              # after

Prints a table row per run: full-proof and cheap-proof steps replayed per trainer step, and the verdicts.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402

from checkpointing._src import verdicts  # noqa: E402
from checkpointing._src.workdir import committed_steps  # noqa: E402
from tests import helpers  # noqa: E402
from trainer import loop  # noqa: E402
from trainer.config import parse_mesh  # noqa: E402
from verifier import program as program_lib  # noqa: E402
from verifier import resume_proof  # noqa: E402
from verifier.verifier import Verifier, VerifierOptions  # noqa: E402

_MESH = flags.DEFINE_string("verifier_mesh", "data=2", "The verifier's mesh (data=4,model=2 records the runs).")
_INTERVALS = flags.DEFINE_list("intervals", ["10", "50"], "Steps between saves; each run is two intervals.")
_MODEL = flags.DEFINE_string("model", "mlp", "The model of the runs (helpers.small_config's).")


class Counter:
    """Counts the steps every replay runs, the cheap proof's apart, by wrapping the replay functions."""

    def __init__(self):
        self.full = self.cheap = 0
        self._in_cheap = False

    def __enter__(self):
        self._real = (program_lib.replay_losses, program_lib.replay_marked_step, resume_proof.prove)
        real_losses, real_marked, real_prove = self._real

        def replay_losses(program, state, start_step, num_steps, *args, **kwargs):
            self._count(num_steps)
            return real_losses(program, state, start_step, num_steps, *args, **kwargs)

        def replay_marked_step(*args, **kwargs):
            self._count(1)
            return real_marked(*args, **kwargs)

        def prove(*args, **kwargs):
            self._in_cheap = True
            try:
                return real_prove(*args, **kwargs)
            finally:
                self._in_cheap = False

        program_lib.replay_losses, program_lib.replay_marked_step, resume_proof.prove = (
            replay_losses, replay_marked_step, prove)
        return self

    def __exit__(self, *exc):
        program_lib.replay_losses, program_lib.replay_marked_step, resume_proof.prove = self._real

    def _count(self, steps: int) -> None:
        if self._in_cheap:
            self.cheap += steps
        else:
            self.full += steps


def main(argv) -> None:
    del argv
    scratch = tempfile.mkdtemp(prefix="proof_cost-")
    print(f"| interval | trainer steps | full proof, replayed per trainer step | cheap proof, per trainer step | "
          f"total | verdicts on {_MESH.value} |\n|---|---|---|---|---|---|", flush=True)
    try:
        for interval in (int(i) for i in _INTERVALS.value):
            workdir = os.path.join(scratch, f"run-{interval}")
            steps = 2 * interval
            loop.train(helpers.small_config(workdir, model=_MODEL.value, steps=steps, save_every_steps=interval,
                                            max_to_keep=100))
            with Counter() as counted:
                Verifier(VerifierOptions(workdir=workdir, mesh=parse_mesh(_MESH.value))).verify_pending()
            found = verdicts.current_steps(workdir, committed_steps(workdir))
            said = ", ".join(f"{s}: {v['level']} {v['status']}" for s, v in sorted(found.items()))
            print(f"| {interval} | {steps} | {counted.full / steps:.2f} | {counted.cheap / steps:.2f} | "
                  f"{(counted.full + counted.cheap) / steps:.2f} | {said} |", flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

if __name__ == "__main__":
    app.run(main)
