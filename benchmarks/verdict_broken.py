"""The verdict matrix's broken runs (benchmarks/verdict_matrix.py): each a real mlp run (seed 0, recorded on
data=4,model=2) damaged one way, with the step that must fail and the steps before it that must pass.

  wrong saves     a step rewritten with a wrong state and its fingerprints recomputed (tests/tamper.py)
  resumes         the run resumed from step 20 by tests/faulty_loop.py with one fault, saving 30: after a crash
                  past 20's probe (the attempt that saved 20 recorded it), or after a preemption at 20 (the
                  broken attempt records it)
  foreign steps   another seed's run's step copied in: in the middle, as the oldest step, as an extra older step
  forgery         params forged to collide with the recorded fingerprints, the manifest untouched
  silent          a wrong value at step 15, between the saves 10 and 20 (tests/faulty_loop.py, fault "corrupt")
"""

import dataclasses
import os
import shutil
from typing import Callable

from benchmarks import verdict_runs
from tests import faulty_loop, helpers, tamper
from tests.tamper import MU_BIAS, KERNEL
from trainer import loop

BASE = {"steps": 30, "save_every_steps": 10, "max_to_keep": 100}  # tests/tamper.py RUN: saves 10, 20, 30
FOREIGN = {**BASE, "seed": 1, "save_every_steps": 5}  # another run, saving at 5 too
RESUMED = {**BASE, "steps": 40}  # the resumed run: from 20 (a crash or a preemption there) to 40
FORGED_LATE = {**BASE, "steps": 60}  # the forgery after the steps before it were proved


@dataclasses.dataclass(frozen=True)
class Broken:
    make: Callable[["Bases", str], None]  # (bases, workdir) -> the damaged run in workdir
    named: int  # the step that must fail
    before: tuple[int, ...]  # the steps before it, which must pass


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


def rewritten(mutate, step: int = 20) -> Callable:
    def make(bases: Bases, workdir: str) -> None:
        tamper.rewrite_step(bases.copy("base", BASE, workdir), step, mutate, keep_saved_fingerprints=False)
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
}
# Resumed with nothing broken: the faulty loop's own saves are the trainer's (a control for the cases above).
CONTROLS = {f"no_fault_after_{after}": Broken(resumed(faulty_loop.Fault(), after), 30, (10, 20))
            for after in ("crash", "preemption")}


def silently_corrupted(bases: Bases, workdir: str, size: float) -> None:
    """A fresh run of BASE whose state after step 15 had one kernel element times (1 + size)."""
    del bases
    shutil.rmtree(workdir, ignore_errors=True)
    faulty_loop.train(helpers.small_config(workdir, **BASE), faulty_loop.Fault("corrupt", size, at_step=15))


def forged_after_proof(bases: Bases, workdir: str, mesh: str) -> dict:
    """The forgery at step 30 after 10..30 were proved on `mesh`, then the rest proved: {"before": the first
    pass's verdicts, "after": every verdict after the second}, each {step: StepResult}."""
    config = bases.copy("late", FORGED_LATE, workdir)
    first = verdict_runs.verify(workdir, mesh, max_steps=3)
    tamper.forge_step(config, 30)
    return {"before": first.steps, "after": verdict_runs.verify(workdir, mesh).steps}
