"""The verdict matrix's genuine runs and its verifier (benchmarks/verdict_matrix.py).

Each family trains real runs: the trainer's loop in this process (8 fake CPU devices), examples/own_loop.py's
program under the public Checkpointer, or a real 2-process pod resumed on 4 processes (the records
transformer). `verify` proves a copy of a run with the real Verifier on a mesh of this process's devices and
reads back every verdict, with the ratio of the cheap proof too (a passing full proof's verdict keeps only its
own): distance / measured noise, verifier/evidence.py.
"""

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys

from checkpointing import CheckpointConfig, Checkpointer
from checkpointing._src.workdir import committed_steps
from checkpointing._src import verdicts
from runtime import exit_codes
from tests import helpers
from tests.records_train import lm_flags
from trainer import loop
from trainer.config import parse_mesh
from verifier import resume_proof
from verifier.verifier import Verifier, VerifierOptions

RECORDING = "data=4,model=2"  # every run here is recorded on it (the records pod: on 2, then 4 processes)
RUN = {"steps": 30, "save_every_steps": 10, "max_to_keep": 100}  # helpers.SHARED_RUN's, saves 10, 20 and 30
WIDE = {"steps": 24, "save_every_steps": 12, "input_dim": 1024, "hidden_dim": 2048, "num_layers": 2}


@dataclasses.dataclass(frozen=True)
class Family:
    overrides: dict  # helpers.small_config's, besides the seed (the trainer's families)
    seeds: tuple[int, ...] = (0, 1, 2)
    meshes: tuple[str, ...] = ("data=2", "data=2,model=4")  # the verifier's, never the recording layout
    trainer: str = "trainer"  # how it trains: trainer, own_loop or records_pod


FAMILIES = {
    "mlp": Family(RUN),
    "transformer": Family({**RUN, "model": "transformer"}),
    "transformer_bf16": Family({**RUN, "model": "transformer", "compute_dtype": "bfloat16"}),
    "wide_mlp": Family(WIDE, seeds=(4, 5, 6)),  # issue 49's seed 4 first
    "bn_classifier": Family({**RUN, "model": "examples.bn_classifier:spec"}),
    "cnn": Family({**RUN, "model": "examples.cnn_model:spec"}),
    "own_loop": Family(RUN, trainer="own_loop"),
    "records_transformer": Family({}, meshes=("data=2",), trainer="records_pod"),
}


def train(family: Family, seed: int, workdir: str, scratch: str, interval: int | None = None,
          recording: str = RECORDING) -> None:
    """One genuine run of `family` with `seed` into `workdir`: its own run, or (with `interval`) two intervals of
    that many steps (saves at `interval` and 2 x `interval`), recorded on `recording`."""
    overrides = dict(family.overrides)
    if interval is not None:
        overrides.update(steps=2 * interval, save_every_steps=interval, max_to_keep=100)
    if family.trainer == "own_loop":
        train_own_loop(workdir, seed, mesh=recording, **overrides)
    elif family.trainer == "records_pod":
        train_records_pod(workdir, seed, records_corpus(scratch))
    else:
        loop.train(helpers.small_config(workdir, mesh=recording, **{**overrides, "seed": seed}))


def train_own_loop(workdir: str, seed: int, steps: int, save_every_steps: int, max_to_keep: int,
                   mesh: str = RECORDING) -> None:
    """examples/own_loop.py's main with another seed: its program, under the public Checkpointer."""
    from examples import own_loop

    config = {**own_loop.CONFIG, "seed": seed}
    mesh = own_loop.make_mesh(mesh)
    program = own_loop.replay_program(config, mesh)
    options = CheckpointConfig(save_every_steps=save_every_steps, max_to_keep=max_to_keep)
    with Checkpointer(workdir, options, config=config, fixed=config, mesh=mesh, total_steps=steps,
                      program="examples.own_loop:replay_program") as checkpointer:
        state = checkpointer.restore_or_init(program.abstract_state, program.init_fn).state
        for step in range(steps):
            state, loss = program.step_fn(state, program.batch_fn(step))
            loss.block_until_ready()
            checkpointer.on_step(step + 1, state, loss)


def records_corpus(scratch: str) -> str:
    """trainer.prepare over the first 6 files of the standard library (conftest's stdlib_corpus), once."""
    from trainer.input import corpus, shards

    out = os.path.join(scratch, "stdlib")
    if not os.path.exists(os.path.join(out, "metadata.json")):
        shutil.rmtree(out, ignore_errors=True)
        shards.prepare(corpus.default_corpus_dir(), out, 32, eval_fraction=0.25, max_files=6, records_per_shard=100)
    return out


def train_records_pod(workdir: str, seed: int, corpus_dir: str) -> None:
    """The transformer on the corpus's records: 16 steps on a 2-process x 4-device pod, then resumed to 32 on
    4 processes x 2 devices (saves every 8)."""
    flags = [f"--workdir={workdir}", *lm_flags(corpus_dir), f"--mesh={RECORDING}", "--save_every_steps=8",
             "--max_to_keep=100", "--log_every_steps=4", f"--seed={seed}"]
    for processes, devices, steps in ((2, 4, 16), (4, 2, 32)):
        run_pod(processes, devices, [*flags, f"--steps={steps}"])


def run_pod(processes: int, devices: int, flags: list[str], timeout_secs: float = 900) -> None:
    """`python -m launch.local` to completion; its whole process group killed by PID on a timeout."""
    command = [sys.executable, "-m", "launch.local", f"--num_processes={processes}",
               f"--devices_per_process={devices}", "--", *flags]
    proc = subprocess.Popen(command, env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_secs)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        raise RuntimeError(f"pod of {processes} processes killed after {timeout_secs:.0f}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"pod of {processes} processes exited {proc.returncode}:\n{out[-3000:]}")


# --- the verifier ---------------------------------------------------------------------------------

@dataclasses.dataclass
class StepResult:
    step: int
    level: str
    status: str
    replayed_from: int | None
    ratio: float | None  # the verdict's evidence ratio (None: bit-exact or not replayed)
    cheap_ratio: float | None  # the cheap proof's, where it ran across layouts
    detail: str
    proved: bool = False  # verdicts.is_proved: what `verify` counts towards its exit 0
    replayed_steps: int = 0  # the steps the full proof replayed on the verifier's layout
    replays: int = 0  # the evidence's replays (the verifier's own and its ensemble's members); 0: none recorded
    perturbation: float = 0.0  # the largest relative perturbation per step of a member

    @property
    def ratios(self) -> list[float]:
        return [r for r in (self.ratio, self.cheap_ratio) if r is not None]


@dataclasses.dataclass
class Verification:
    mesh: str
    steps: dict[int, StepResult]

    @property
    def exit_code(self) -> int:
        """python -m verifier.verify --once's (verify.exit_code): 1 when a committed step's verdict failed, else
        UNPROVED (3) when one is not proved (intact, replayed, inconclusive, error), else 0."""
        if any(s.status == "fail" for s in self.steps.values()):
            return exit_codes.FAILURE
        return exit_codes.OK if all(s.proved for s in self.steps.values()) else exit_codes.UNPROVED

    def count(self, status: str) -> int:
        return sum(s.status == status for s in self.steps.values())


@contextlib.contextmanager
def cheap_proofs_seen():
    """{step: ResumeResult} of every cheap proof run meanwhile (resume_proof.prove, the real one, called)."""
    seen, real = {}, resume_proof.prove

    def recording(replay, program, start_state, step, *args, **kwargs):
        seen[step] = real(replay, program, start_state, step, *args, **kwargs)
        return seen[step]

    resume_proof.prove = recording
    try:
        yield seen
    finally:
        resume_proof.prove = real


def verify(workdir: str, mesh: str, max_steps: int | None = None) -> Verification:
    """Proves the pending steps of `workdir` on `mesh` (full proof at every save, the cheap one where a probe
    is) and reads back every committed step's verdict."""
    with cheap_proofs_seen() as cheap:
        Verifier(VerifierOptions(workdir=workdir, mesh=parse_mesh(mesh))).verify_pending(max_steps)
    found = verdicts.current_steps(workdir, committed_steps(workdir))
    return Verification(mesh, {step: _result(step, v, cheap.get(step)) for step, v in sorted(found.items())})


def _result(step: int, verdict: dict, cheap) -> StepResult:
    evidence = verdict.get("evidence") or {}
    return StepResult(step, verdict["level"], verdict["status"], verdict.get("replayed_from"),
                      _finite(evidence.get("ratio")), _cheap_ratio(cheap), verdict["detail"],
                      proved=verdicts.is_proved(verdict), replayed_steps=int(verdict.get("replayed_steps") or 0),
                      replays=int(evidence.get("replays") or 0), perturbation=float(evidence.get("perturbation") or 0))


def verify_copy(workdir: str, mesh: str, copy_to: str) -> Verification:
    """`verify` of a fresh copy of `workdir` (each layout writes verdicts of its own)."""
    shutil.rmtree(copy_to, ignore_errors=True)
    shutil.copytree(workdir, copy_to)
    try:
        return verify(copy_to, mesh)
    finally:
        shutil.rmtree(copy_to, ignore_errors=True)


def _cheap_ratio(result) -> float | None:
    if result is None or result.exact:
        return None
    judgement = result.judgement
    return _finite(judgement.findings[0].ratio if judgement.findings else judgement.largest)


def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
