"""The verdict matrix's broken runs (benchmarks/verdict_matrix.py): each a real mlp run (seed 0, recorded on
data=4,model=2) damaged one way, with the step that must fail and the steps before it that must pass.

  wrong saves     a step rewritten with a wrong state and its fingerprints recomputed (tests/tamper.py)
  resumes         the run resumed from step 20 by tests/faulty_loop.py with one fault, saving 30: after a crash
                  past 20's probe (the attempt that saved 20 recorded it), or after a preemption at 20 (the
                  broken attempt records it)
  foreign steps   another seed's run's step copied in: in the middle, as the oldest step, as an extra older step
  forgery         params forged to collide with the recorded fingerprints, the manifest untouched
  wide leaves     the bn classifier's BatchNorm running mean, or the bias before its BatchNorm (a leaf whose genuine
                  spread is wide: rounding noise only, turned into full steps by Adam), moved by +3.0
  copied step     an operator copies step 20 to checkpoints/25, and step 30's params are x (1 + 1e-5 noise): proved
                  on the recording layout, where the comparison stays bit for bit
  silent          a wrong value at step 15, between the saves 10 and 20 (tests/faulty_loop.py, fault "corrupt"), or
                  one input element x (1 + size) at step 15 and every 29 steps after it ("corrupt_input")
"""

import dataclasses
import os
import shutil
from typing import Callable

from benchmarks import verdict_runs
from checkpointing._src import workdir as workdir_lib
from tests import faulty_loop, helpers, tamper
from tests.tamper import MU_BIAS, KERNEL
from trainer import loop

BASE = {"steps": 30, "save_every_steps": 10, "max_to_keep": 100}  # tests/tamper.py RUN: saves 10, 20, 30
FOREIGN = {**BASE, "seed": 1, "save_every_steps": 5}  # another run, saving at 5 too
RESUMED = {**BASE, "steps": 40}  # the resumed run: from 20 (a crash or a preemption there) to 40
FORGED_LATE = {**BASE, "steps": 60}  # the forgery after the steps before it were proved
BN = {**BASE, "model": "examples.bn_classifier:spec"}  # Dense with bias -> BatchNorm -> LayerNorm -> dropout
BN_MEAN = ".model_state['batch_stats']['BatchNorm_0']['mean']"
BN_BIAS = ".params['Dense_0']['bias']"  # right before the BatchNorm: no gradient, rounding noise only
RECORDING = verdict_runs.RECORDING
SILENT_EVERY = 29  # a flaky input: one step in 29 (in a run of 30: the step at 15 only)


@dataclasses.dataclass(frozen=True)
class Broken:
    make: Callable[["Bases", str], None]  # (bases, workdir) -> the damaged run in workdir
    named: int  # the step that must fail
    before: tuple[int, ...]  # the steps before it, which must pass
    meshes: tuple[str, ...] = ()  # the verifier meshes it is proved on (empty: --broken_meshes)


class Bases:
    """The undamaged runs every case copies, each trained once into `scratch`."""

    def __init__(self, scratch: str):
        self.scratch = scratch
        self._trained: dict[str, str] = {}

    def run(self, name: str, overrides: dict) -> str:
        if name not in self._trained:
            workdir = os.path.join(self.scratch, f"base-{name}")
            shutil.rmtree(workdir, ignore_errors=True)
            loop.train(helpers.small_config(workdir, **overrides))
            self._trained[name] = workdir
        return self._trained[name]

    def copy(self, name: str, overrides: dict, workdir: str):
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(self.run(name, overrides), workdir)
        return helpers.small_config(workdir, **overrides)


def rewritten(mutate, step: int = 20, base: tuple[str, dict] = ("base", BASE)) -> Callable:
    def make(bases: Bases, workdir: str) -> None:
        tamper.rewrite_step(bases.copy(*base, workdir), step, mutate, keep_saved_fingerprints=False)
    return make


def copied_beside_noise(bases: Bases, workdir: str) -> None:
    """Step 20 copied to checkpoints/25 by hand, step 30's params x (1 + 1e-5 noise), fingerprints recomputed: a
    step that is not a save of the run lies inside 30's interval, and must not turn bit for bit into a bound."""
    config = bases.copy("base", BASE, workdir)
    shutil.copytree(str(workdir_lib.step_dir(workdir, 20)), str(workdir_lib.step_dir(workdir, 25)))
    tamper.rewrite_step(config, 30, tamper.noisy_params(1e-5), keep_saved_fingerprints=False)


def silent_input(size: float) -> Callable:
    def make(bases: Bases, workdir: str) -> None:
        del bases
        shutil.rmtree(workdir, ignore_errors=True)
        faulty_loop.train(helpers.small_config(workdir, **BASE),
                          faulty_loop.Fault("corrupt_input", size, at_step=15, every=SILENT_EVERY))
    return make


def resumed(fault: faulty_loop.Fault, after: str) -> Callable:
    """Resumed from 20 with `fault`: after a crash past 20's probe (step 30 never committed), or after a
    preemption at 20 (the run's last save, no probe of it yet)."""
    def make(bases: Bases, workdir: str) -> None:
        if after == "crash":
            bases.copy("base", BASE, workdir)
            shutil.rmtree(helpers.checkpoint_dir(workdir, "30"))
        else:
            bases.copy("base20", {**BASE, "steps": 20}, workdir)
        faulty_loop.train(helpers.small_config(workdir, **RESUMED), fault)
    return make


def foreign(source_step: int, as_step: int) -> Callable:
    def make(bases: Bases, workdir: str) -> None:
        bases.copy("base", BASE, workdir)
        tamper.copy_foreign_step(bases.run("foreign", FOREIGN), source_step, workdir, as_step)
    return make


def forged(bases: Bases, workdir: str) -> None:
    tamper.forge_step(bases.copy("base", BASE, workdir), 20)


RESUME_FAULTS = (("restarted_step_index", 0), ("restarted_loop_counter", 0), ("zeroed_moments", 0),
                 ("other_learning_rate", 1.1), ("skipped_batch", 0), ("repeated_batch", 0))
CASES = {
    "zeroed_moments_saved": Broken(rewritten(tamper.zero_adam_moments), 20, (10,)),
    "swapped_moments_saved": Broken(rewritten(tamper.swap_adam_moments), 20, (10,)),
    "one_leaf_x_1e-3_noise": Broken(rewritten(tamper.scale_one_leaf(KERNEL, 1e-3)), 20, (10,)),
    "bias_first_moment_sign": Broken(rewritten(tamper.flip_one_sign(MU_BIAS)), 20, (10,)),
    **{f"{kind}_after_{after}": Broken(resumed(faulty_loop.Fault(kind, size), after), 30, (10, 20))
       for after in ("crash", "preemption") for kind, size in RESUME_FAULTS},
    "other_seed_step": Broken(foreign(20, 20), 20, (10,)),
    "foreign_oldest_step": Broken(foreign(10, 10), 10, ()),
    "foreign_extra_older_step": Broken(foreign(5, 5), 5, ()),
    "forged_collision": Broken(forged, 20, (10,)),
    "bn_running_mean_plus_3": Broken(rewritten(tamper.shift_leaf(BN_MEAN, 3.0), base=("bn", BN)), 20, (10,)),
    "bias_before_bn_plus_3": Broken(rewritten(tamper.shift_leaf(BN_BIAS, 3.0), base=("bn", BN)), 20, (10,)),
    "copied_step_beside_params_1e-5_noise": Broken(copied_beside_noise, 30, (10, 20), meshes=(RECORDING,)),
    "input_x_1e-3_one_step_in_29": Broken(silent_input(1e-3), 20, (10,)),
}
# Resumed with nothing broken: the faulty loop's own saves are the trainer's (a control for the cases above).
CONTROLS = {f"no_fault_after_{after}": Broken(resumed(faulty_loop.Fault(), after), 30, (10, 20))
            for after in ("crash", "preemption")}


def silently_corrupted(bases: Bases, workdir: str, size: float, kind: str = "kernel",
                       overrides: dict | None = None) -> None:
    """A fresh run of BASE (with `overrides`: another model) whose state after step 15 had one element of `kind`
    times (1 + size): "kernel", a leaf of the state (KERNEL, else the model's first 2-D params leaf), or "input",
    one element of step 15's batch (and of every SILENT_EVERY-th step after it)."""
    del bases
    shutil.rmtree(workdir, ignore_errors=True)
    config = helpers.small_config(workdir, **{**BASE, **(overrides or {})})
    if kind == "input":
        fault = faulty_loop.Fault("corrupt_input", size, at_step=15, every=SILENT_EVERY)
    else:
        fault = faulty_loop.Fault("corrupt", size, at_step=15, leaf=kernel_of(config))
    faulty_loop.train(config, fault)


def kernel_of(config) -> str:
    """KERNEL where the model has it, else its first params leaf of two dimensions (a kernel or an embedding)."""
    import jax

    from trainer.program import build_mesh, build_program

    abstract = build_program(config, build_mesh(config)).abstract_state
    paths = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    if any(path == KERNEL for path, _ in paths):
        return KERNEL
    return next(path for path, leaf in paths if path.startswith(".params") and len(leaf.shape) == 2)


def forged_after_proof(bases: Bases, workdir: str, mesh: str) -> dict:
    """The forgery at step 30 after 10..30 were proved on `mesh`, then the rest proved: {"before": the first
    pass's verdicts, "after": every verdict after the second}, each {step: StepResult}."""
    config = bases.copy("late", FORGED_LATE, workdir)
    first = verdict_runs.verify(workdir, mesh, max_steps=3)
    tamper.forge_step(config, 30)
    return {"before": first.steps, "after": verdict_runs.verify(workdir, mesh).steps}
