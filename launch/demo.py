"""The demo: a local pod trains, crashes, resumes from its local tier, is preempted, resumes on
another layout and is verified.

  python -m launch.demo --workdir=DIR

1. An uninterrupted reference run: a 2-process x 4-device pod on data=4,model=2.
2. The same job in a fresh workdir, also saving to each process's local tier (<workdir>/local-N)
   every half interval: process 1 is SIGKILLed (a crash) once a local step newer than the last
   persistent one is committed.
3. Requeued on the same layout: it resumes from that local step, and is preempted mid-run by
   SIGTERM to process 1 only: both processes agree on a step, save it and exit 75 ("requeue me").
4. Requeued on another layout, 4 processes x 2 devices on data=8: the local steps belong to the
   old layout, so it resumes from the persistent preemption checkpoint and finishes.
5. The verifier, its own process on data=2, proves every checkpoint.
It prints one row per checkpoint (step, how it was committed, the run it resumed, the verdict) and
a last line saying whether the resumed loss list equals the uninterrupted run's, then draws the run
into <workdir>/run.png (as `trainer.inspect --plot --reference` does: each attempt shaded by
layout, the SIGKILL, the resumes, the preemption, and a second panel with each step's relative
difference to the uninterrupted run against the tolerance) and prints its path. Each pod's output
is in <workdir>/logs/. Exit 0 if everything held, 1 otherwise.
"""

import dataclasses
import os
import subprocess
import sys
import time

import psutil
from absl import flags, logging

from checkpointing.verification import compare
from checkpointing.verification import manifest as manifest_lib
from checkpointing.verification import plot, plot_draw
from checkpointing.verification import verdicts
from checkpointing.verification import workdir as workdir_lib
from checkpointing.config import format_mesh, resolve_path
from checkpointing.verification import recorded_losses
from checkpointing.verification import committed_steps, read_manifest
from runtime import entry, exit_codes
from launch.outcomes import exit_line
from trainer import models

WORKDIR = flags.DEFINE_string("workdir", None, "Where the demo's runs go (created).")
STEPS = flags.DEFINE_integer("steps", 300, "Steps of the training job.", lower_bound=20)
SAVE_EVERY_STEPS = flags.DEFINE_integer("save_every_steps", 50, "Checkpoint cadence.", lower_bound=1)
MODEL = flags.DEFINE_string("model", "mlp", "Model to train: mlp, transformer or package.module:name "
                            "naming a trainer.models.ModelSpec.")

# Losses reach metrics.jsonl every 5 steps, so the picture shows how far the crashed attempt got.
TRAIN_FLAGS = ["--batch_size=32", "--log_every_steps=5", "--max_to_keep=100"]



@dataclasses.dataclass
class Launched:
    proc: subprocess.Popen  # the launcher
    log_path: str  # its output, where it says how each process ended


def _pod(num_processes: int, devices_per_process: int, module: str, flags_: list[str], log_path: str):
    command = [sys.executable, "-m", "launch.local", f"--num_processes={num_processes}",
               f"--devices_per_process={devices_per_process}", f"--module={module}", "--", *flags_]
    return Launched(subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT), log_path)


def _run(step_name: str, launched: Launched, timeout: float = 600) -> int:
    code = launched.proc.wait(timeout=timeout)
    with open(launched.log_path) as log:
        logging.info("%s", exit_line(step_name, code, log.read()))
    return code


def _signal_process_1(launched: Launched, committed, what: str, kill: bool = False) -> None:
    """SIGTERM (or SIGKILL) to process 1 of the pod only, once committed() is true."""
    while not committed():
        if launched.proc.poll() is not None:
            raise RuntimeError(f"the pod finished before it could be {what}")
        time.sleep(0.02)
    children = psutil.Process(launched.proc.pid).children()
    (target,) = [c for c in children if "--process_id=1" in c.cmdline()]
    logging.info("%s: %s to process 1 (pid %d) only", what, "SIGKILL" if kill else "SIGTERM", target.pid)
    target.kill() if kill else target.terminate()


def run_demo(root: str, steps: int, save_every_steps: int, model: str) -> bool:
    logs_dir = os.path.join(root, "logs")
    os.makedirs(logs_dir, exist_ok=True)
    reference, run = os.path.join(root, "uninterrupted"), os.path.join(root, "run")
    local_dir = os.path.join(root, "local-{process}")
    common = [f"--model={model}", f"--steps={steps}", f"--save_every_steps={save_every_steps}", *TRAIN_FLAGS]
    tiers = [f"--local_dir={local_dir}", f"--local_save_every_steps={max(save_every_steps // 2, 1)}"]
    first_layout = ["--mesh=data=4,model=2"]

    logging.info("1/5 uninterrupted reference: 2 processes x 4 devices, data=4,model=2")
    ok = _run("reference", _pod(2, 4, "trainer.train", [f"--workdir={reference}", *common, *first_layout],
                                os.path.join(logs_dir, "1-reference.log"))) == exit_codes.OK

    # A local step past the first persistent one, committed on both processes: the crash loses no work.
    crash_after = save_every_steps + max(save_every_steps // 2, 1)
    logging.info("2/5 the job, with a local tier: 2 processes x 4 devices, crashed mid-run")
    launcher = _pod(2, 4, "trainer.train", [f"--workdir={run}", *common, *first_layout, *tiers],
                    os.path.join(logs_dir, "2-crashed.log"))
    try:
        local_dirs = [workdir_lib.expand_local_dir(local_dir, i) for i in range(2)]
        _signal_process_1(launcher, lambda: all(crash_after in committed_steps(d) for d in local_dirs), "crashing",
                          kill=True)
        ok &= _run("crashed job", launcher) != exit_codes.OK
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()

    logging.info("3/5 requeued on the same layout: resumes from the local tier, preempted mid-run")
    launcher = _pod(2, 4, "trainer.train", [f"--workdir={run}", *common, *first_layout, *tiers],
                    os.path.join(logs_dir, "3-preempted.log"))
    try:
        _signal_process_1(launcher, lambda: 3 * save_every_steps in committed_steps(run), "preempting")
        ok &= _run("preempted job", launcher) == exit_codes.PREEMPTED
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
    preempted_at = committed_steps(run)[-1]

    logging.info("4/5 requeued on another layout: 4 processes x 2 devices, data=8")
    ok &= _run("resumed job", _pod(4, 2, "trainer.train", [f"--workdir={run}", *common, "--mesh=data=8", *tiers],
                                   os.path.join(logs_dir, "4-resumed.log"))) == exit_codes.OK

    logging.info("5/5 the verifier: its own process, data=2")
    ok &= _run("verifier", _pod(1, 2, "verifier.verify", [f"--workdir={run}", "--mesh=data=2", "--once"],
                                os.path.join(logs_dir, "5-verifier.log"))) == exit_codes.OK

    sys.stdout.write(report(run, reference, preempted_at, model) + "\n")
    picture = os.path.join(root, "run.png")
    draw_picture(run, reference, picture, title=f"{os.path.basename(os.path.normpath(root))}: the job crashed, "
                 "resumed from its local tier, was preempted, resumed on another layout", model=model)
    sys.stdout.write(f"PICTURE: {picture} (loss against step; checkpoints by verdict, the preemption, the resume)\n")
    return ok and equal_loss_lists(run, reference, preempted_at, model)[0]


def draw_picture(run: str, reference: str, path: str, *, title: str, model: str) -> None:
    """The run's history over the uninterrupted one's, and the proof panel at the model's tolerance."""
    series, expected = plot.series(run), plot.reference_loss(reference)
    proof = plot.proof_series(series, expected, models.resolve(model).cross_mesh_loss_rtol)
    plot_draw.draw(series, path, title=title, reference=expected, proof=proof, crash_label="SIGKILL to process 1")


def equal_loss_lists(run: str, reference: str, preempted_at: int, model: str) -> tuple[bool, str]:
    resumed, expected = recorded_losses(run), recorded_losses(reference)
    if sorted(resumed) != sorted(expected):
        return False, f"the runs recorded different steps ({len(resumed)} vs {len(expected)})"
    before = [s for s in expected if s < preempted_at]
    after = [s for s in expected if s >= preempted_at]
    rtol = models.resolve(model).cross_mesh_loss_rtol
    # The verifier's own rule and comparison: bit-exact on the same layout, the model's rtol on
    # another, NaN always fails.
    exact = compare.compare_losses(resumed, {s: expected[s] for s in before}, 0.0)[0] is None
    mismatch, worst = compare.compare_losses(resumed, {s: expected[s] for s in after}, rtol)
    holds = exact and mismatch is None
    return holds, (f"steps 0..{preempted_at - 1} {'bit-identical' if exact else 'DIFFER'} (same 2x4 layout); "
                   f"steps {preempted_at}..{max(expected)} on 4x2 data=8 max relative difference {worst:.2e} "
                   f"({'<=' if mismatch is None else '>'} {rtol:g})")


def report(run: str, reference: str, preempted_at: int, model: str) -> str:
    rows = [("step", "committed", "resumed_from", "verdict")]
    for step in committed_steps(run):
        manifest = read_manifest(run, step)
        resumed = (manifest.get("extra") or {}).get("resumed_from")
        rows.append((str(step), f"yes ({manifest['reason']}, {manifest['process_count']} processes, "
                                f"{format_mesh(manifest['mesh'])}, {len(manifest_lib.losses(manifest))} losses)",
                     f"{resumed['step']}({resumed['tier']})" if resumed else "-",
                     verdicts.summary(verdicts.read(run, step))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    holds, detail = equal_loss_lists(run, reference, preempted_at, model)
    lines.append(f"RESULT: the resumed loss list {'equals' if holds else 'does NOT equal'} the uninterrupted "
                 f"run's: {detail}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    models.resolve(MODEL.value)  # a bad --model is one line and exit 2, before anything is written
    if not WORKDIR.value:
        raise ValueError("--workdir is required")
    workdir = resolve_path(WORKDIR.value, "--workdir")  # the pods' processes share it whatever their directory
    if os.path.exists(workdir) and os.listdir(workdir):
        raise ValueError(f"--workdir={workdir} is not empty; the demo needs a fresh one")
    ok = run_demo(workdir, STEPS.value, SAVE_EVERY_STEPS.value, MODEL.value)
    return exit_codes.OK if ok else exit_codes.FAILURE


if __name__ == "__main__":
    entry.run(main)
