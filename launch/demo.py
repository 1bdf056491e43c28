"""The demo: a local pod trains, is preempted, resumes on another layout and is verified.

  python -m launch.demo --workdir=DIR

1. An uninterrupted reference run: a 2-process x 4-device pod on data=4,model=2.
2. The same job in a fresh workdir, preempted mid-run by SIGTERM to process 1 only: both
   processes agree on a step, save it and exit 75 ("requeue me").
3. The requeued job comes back on another layout, 4 processes x 2 devices on data=8, resumes from
   the preemption checkpoint and finishes.
4. The verifier, its own process on data=2, proves every checkpoint.
It prints one row per checkpoint (step, how it was committed, the verdict) and a last line
saying whether the resumed loss list equals the uninterrupted run's, then draws the run into
<workdir>/run.png (as `trainer.inspect --plot` does) and prints its path. Each pod's output
is in <workdir>/logs/. Exit 0 if everything held, 1 otherwise.
"""

import os
import subprocess
import sys
import time

import psutil
from absl import flags, logging

from checkpointing import compare
from checkpointing import manifest as manifest_lib
from checkpointing import plot
from checkpointing import verdicts
from checkpointing.report import recorded_losses
from checkpointing.service import committed_steps, read_manifest
from runtime import entry, exit_codes, logs
from trainer.step import CROSS_MESH_LOSS_RTOL

WORKDIR = flags.DEFINE_string("workdir", None, "Where the demo's runs go (created).")
STEPS = flags.DEFINE_integer("steps", 300, "Steps of the training job.", lower_bound=20)
SAVE_EVERY_STEPS = flags.DEFINE_integer("save_every_steps", 50, "Checkpoint cadence.", lower_bound=1)
MODEL = flags.DEFINE_enum("model", "mlp", ["mlp", "transformer"], "Model to train.")

TRAIN_FLAGS = ["--batch_size=32", "--log_every_steps=25", "--max_to_keep=100"]


def _pod(num_processes: int, devices_per_process: int, module: str, flags_: list[str], log_path: str):
    command = [sys.executable, "-m", "launch.local", f"--num_processes={num_processes}",
               f"--devices_per_process={devices_per_process}", f"--module={module}", "--", *flags_]
    return subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def _run(step_name: str, proc: subprocess.Popen, timeout: float = 600) -> int:
    code = proc.wait(timeout=timeout)
    logging.info("%s: exit code %d", step_name, code)
    return code


def _preempt_process_1(launcher: subprocess.Popen, workdir: str, after_step: int) -> None:
    """SIGTERM to process 1 of the pod (only), once `after_step` is committed."""
    while after_step not in committed_steps(workdir):
        if launcher.poll() is not None:
            raise RuntimeError("the pod finished before it could be preempted")
        time.sleep(0.02)
    children = psutil.Process(launcher.pid).children()
    (target,) = [c for c in children if "--process_id=1" in c.cmdline()]
    logging.info("preempting: SIGTERM to process 1 (pid %d) only", target.pid)
    target.terminate()


def run_demo(root: str, steps: int, save_every_steps: int, model: str) -> bool:
    logs_dir = os.path.join(root, "logs")
    os.makedirs(logs_dir, exist_ok=True)
    reference, run = os.path.join(root, "uninterrupted"), os.path.join(root, "run")
    common = [f"--model={model}", f"--steps={steps}", f"--save_every_steps={save_every_steps}", *TRAIN_FLAGS]
    first_layout = ["--mesh=data=4,model=2"]

    logging.info("1/4 uninterrupted reference: 2 processes x 4 devices, data=4,model=2")
    ok = _run("reference", _pod(2, 4, "trainer.train", [f"--workdir={reference}", *common, *first_layout],
                                os.path.join(logs_dir, "1-reference.log"))) == exit_codes.OK

    logging.info("2/4 the job: 2 processes x 4 devices, preempted mid-run")
    launcher = _pod(2, 4, "trainer.train", [f"--workdir={run}", *common, *first_layout],
                    os.path.join(logs_dir, "2-preempted.log"))
    try:
        _preempt_process_1(launcher, run, 2 * save_every_steps)
        ok &= _run("preempted job", launcher) == exit_codes.PREEMPTED
    finally:
        if launcher.poll() is None:
            launcher.kill()
    preempted_at = committed_steps(run)[-1]

    logging.info("3/4 requeued on another layout: 4 processes x 2 devices, data=8")
    ok &= _run("resumed job", _pod(4, 2, "trainer.train", [f"--workdir={run}", *common, "--mesh=data=8"],
                                   os.path.join(logs_dir, "3-resumed.log"))) == exit_codes.OK

    logging.info("4/4 the verifier: its own process, data=2")
    ok &= _run("verifier", _pod(1, 2, "trainer.verify", [f"--workdir={run}", "--mesh=data=2", "--once"],
                                os.path.join(logs_dir, "4-verifier.log"))) == exit_codes.OK

    sys.stdout.write(report(run, reference, preempted_at, model) + "\n")
    picture = os.path.join(root, "run.png")
    plot.draw(plot.series(run), picture, title=f"demo: {run}", reference=plot.reference_loss(reference))
    sys.stdout.write(f"PICTURE: {picture} (loss against step; checkpoints by verdict, the preemption, the resume)\n")
    return ok and equal_loss_lists(run, reference, preempted_at, model)[0]


def equal_loss_lists(run: str, reference: str, preempted_at: int, model: str) -> tuple[bool, str]:
    resumed, expected = recorded_losses(run), recorded_losses(reference)
    if sorted(resumed) != sorted(expected):
        return False, f"the runs recorded different steps ({len(resumed)} vs {len(expected)})"
    before = [s for s in expected if s < preempted_at]
    after = [s for s in expected if s >= preempted_at]
    rtol = CROSS_MESH_LOSS_RTOL[model]
    # The verifier's own comparisons: bit-exact on the same layout, rtol on another, NaN always fails.
    exact = compare.compare_losses(resumed, {s: expected[s] for s in before}, 0.0)[0] is None
    mismatch, worst = compare.compare_losses(resumed, {s: expected[s] for s in after}, rtol)
    holds = exact and mismatch is None
    return holds, (f"steps 0..{preempted_at - 1} {'bit-identical' if exact else 'DIFFER'} (same 2x4 layout); "
                   f"steps {preempted_at}..{max(expected)} on 4x2 data=8 max relative difference {worst:.2e} "
                   f"({'<=' if mismatch is None else '>'} {rtol:g})")


def report(run: str, reference: str, preempted_at: int, model: str) -> str:
    rows = [("step", "committed", "verdict")]
    for step in committed_steps(run):
        manifest = read_manifest(run, step)
        mesh = ",".join(f"{a}={n}" for a, n in manifest["mesh"].items())
        rows.append((str(step), f"yes ({manifest['reason']}, {manifest['process_count']} processes, {mesh}, "
                                f"{len(manifest_lib.losses(manifest))} losses)",
                     verdicts.summary(verdicts.read(run, step))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    holds, detail = equal_loss_lists(run, reference, preempted_at, model)
    lines.append(f"RESULT: the resumed loss list {'equals' if holds else 'does NOT equal'} the uninterrupted "
                 f"run's: {detail}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    logs.quiet_library_logs()
    if not WORKDIR.value:
        exit_codes.exit_bad_input(ValueError("--workdir is required"))
    if os.path.exists(WORKDIR.value) and os.listdir(WORKDIR.value):
        exit_codes.exit_bad_input(ValueError(f"--workdir={WORKDIR.value} is not empty; the demo needs a fresh one"))
    ok = run_demo(WORKDIR.value, STEPS.value, SAVE_EVERY_STEPS.value, MODEL.value)
    sys.exit(exit_codes.OK if ok else exit_codes.FAILURE)


if __name__ == "__main__":
    entry.run(main)
