"""The service against plain Orbax on whatever JAX finds (the TPU chip where there is one), in one process tree.

  python -m benchmarks.device_bench [--parts=checkpoint,goodput,restart,verifier] [--json_out=FILE]

benchmarks/device_run.sh runs it on a device machine (set-up included). Nothing here opens a socket (such a
machine refuses them: no jax.distributed, no local pod), and one program at a time holds the chip: every
measured program runs in a process of its own, one after the other, with the caller's environment (JAX picks
the accelerator; with JAX_PLATFORMS=cpu and no accelerator, one CPU device). The parts:

  checkpoint  per --state_gibs: save() blocking, save -> commit and restore, the service against plain Orbax,
              beside the machine's own limits for the same bytes (benchmarks/device_child.py)
  goodput     steps/s over a run of the transformer (--hidden_dim ...), no saves (plain_orbax_trainer
              --noplain_save), plain Orbax and the service, at the --realistic cadence and the --write_bound one
  restart     each write-bound run relaunched for --restart_steps more: its `phase` lines (open, compile with
              the warm cache, restore, first step), the service against plain Orbax
  verifier    a smaller run (--verifier_model_flags) trained with the verifier following beside it on 4 host
              CPU devices (JAX_PLATFORMS=cpu): trainer steps proved and replayed per second against trained
Prints a markdown report; --json_out writes the numbers. Every child is killed by PID on timeout.
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags, logging

from benchmarks import device_report
from benchmarks.common import ROOT
from benchmarks.verifier_pace import verifier_pace
from benchmarks.verifier_scan import scan
from checkpointing._src.workdir import step_dir, verdict_file
from runtime import entry

PARTS = ("checkpoint", "goodput", "restart", "verifier")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Which parts to run, of {', '.join(PARTS)}.")
_STATE_GIBS = flags.DEFINE_list("state_gibs", ["1", "4"], "The checkpoint part's state sizes, GiB.")
_ARRAY_MIB = flags.DEFINE_integer("array_mib", 128, "The checkpoint part's array size, MiB.")
_SAMPLES = flags.DEFINE_integer("samples", 2, "The checkpoint part's measured rounds per size.")
_MODEL = flags.DEFINE_list("model_flags", ["--model=transformer", "--hidden_dim=1024", "--num_layers=8",
                                           "--num_heads=8", "--seq_len=256", "--vocab_size=8192", "--batch_size=16"],
                           "The goodput and restart runs' model (a 108M-parameter transformer: 1.3 GB with Adam).")
_REALISTIC = flags.DEFINE_list("realistic", ["1200", "300"], "STEPS,EVERY of the realistic cadence (4 saves: the "
                                "final commit, which every variant waits for, weighs a quarter as much).")
_WRITE_BOUND = flags.DEFINE_list("write_bound", ["120", "20"], "STEPS,EVERY of the write-bound cadence.")
_RESTART_STEPS = flags.DEFINE_integer("restart_steps", 5, "Steps each restart runs.")
_VERIFIER_MODEL = flags.DEFINE_list(
    "verifier_model_flags", ["--model=transformer", "--hidden_dim=256", "--num_layers=2", "--num_heads=4",
                             "--seq_len=128", "--vocab_size=4096", "--batch_size=8"], "The verifier part's model.")
_VERIFIER_RUN = flags.DEFINE_list("verifier_run", ["200", "40"], "STEPS,EVERY of the verifier part's run.")
_VERIFIER_GRACE = flags.DEFINE_float("verifier_grace_secs", 90, "How long the verifier may go on after training.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch space is made under this (default $TMPDIR) and removed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results here as JSON.")
_TIMEOUT = flags.DEFINE_float("child_timeout_secs", 600, "Kill a child after this long.")

DONE = re.compile(r"done: steps \d+\.\.\d+, (?:final loss \S+, )?([\d.]+) steps/s")
PHASE = re.compile(r"\bphase (\w+) ([0-9.]+)s\b")
HANDED_OFF = re.compile(r"checkpoint: step \d+ \(\w+\) handed off in ([0-9.]+)s")
TRAINERS = {"ideal": ["benchmarks.plain_orbax_trainer", "--noplain_save"],
            "plain_orbax": ["benchmarks.plain_orbax_trainer"], "service": ["trainer.train"]}


VERIFIER_CPU_DEVICES = 4  # the verifier's host CPU devices: other layouts to measure the noise of a change with


def child_env(cpu: bool = False) -> dict:
    """The caller's environment (JAX picks the devices), or the verifier's: VERIFIER_CPU_DEVICES host CPU devices."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    if not cpu:
        return env
    xla = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return dict(env, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{xla} --xla_force_host_platform_device_count={VERIFIER_CPU_DEVICES}".strip())


def run(command: list[str], log_path: str, cpu: bool = False) -> str:
    """Runs a child to its end (killed by PID after --child_timeout_secs); returns its output; raises if it failed."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=child_env(cpu), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=_TIMEOUT.value)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
    text = open(log_path).read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} exited {proc.returncode}:\n{text[-3000:]}")
    return text


def devices() -> dict:
    """What JAX finds, asked in a child (this process never holds the chip)."""
    code = ("import json, jax; from checkpointing._src.platform_record import record; "
            "print(json.dumps({'count': jax.device_count(), **record()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=_TIMEOUT.value, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint_part(scratch: str) -> dict:
    results = {}
    for gib in _STATE_GIBS.value:
        root = os.path.join(scratch, f"checkpoint_{gib}")
        os.makedirs(root)
        out = run([sys.executable, "-m", "benchmarks.device_child", f"--state_gib={gib}",
                   f"--array_mib={_ARRAY_MIB.value}", f"--root={root}", f"--samples={_SAMPLES.value}"],
                  os.path.join(scratch, f"checkpoint_{gib}.log"))
        shutil.rmtree(root)
        results[gib] = json.loads(out.strip().splitlines()[-1])
    return results


def train(variant: str, workdir: str, steps: int, every: int, mesh: str, log: str, extra=()) -> dict:
    """One trainer run: its steps/s, `phase` seconds and save() blocking seconds, from its log."""
    module, *variant_flags = TRAINERS[variant]
    text = run([sys.executable, "-m", module, f"--workdir={workdir}", f"--mesh={mesh}", f"--steps={steps}",
                f"--save_every_steps={every}", "--log_every_steps=10", *_MODEL.value, *variant_flags, *extra], log)
    done = DONE.findall(text)
    if not done:
        raise RuntimeError(f"{variant}: no 'done' line in {log}")
    return {"steps_per_sec": float(done[-1]), "phases": {k: float(v) for k, v in PHASE.findall(text)},
            "blocking": [float(x) for x in HANDED_OFF.findall(text)]}


def goodput_part(scratch: str, mesh: str, restart: bool) -> tuple[dict, dict]:
    goodput, restarts = {}, {}
    for cadence, (steps, every) in (("realistic", _REALISTIC.value), ("write_bound", _WRITE_BOUND.value)):
        goodput[cadence] = {}
        for variant in TRAINERS:
            workdir = os.path.join(scratch, f"{cadence}_{variant}")
            goodput[cadence][variant] = train(variant, workdir, int(steps), int(every), mesh,
                                              f"{workdir}.log")
            if restart and cadence == "write_bound" and variant != "ideal":
                restarts[variant] = train(variant, workdir, int(steps) + _RESTART_STEPS.value, int(every), mesh,
                                          f"{workdir}_restart.log")["phases"]
            shutil.rmtree(workdir, ignore_errors=True)
    return goodput, restarts


def verifier_part(scratch: str, mesh: str) -> dict:
    """The trainer on the devices with the verifier following on the host CPU; then the trainer alone."""
    steps, every = (int(x) for x in _VERIFIER_RUN.value)
    common = [f"--mesh={mesh}", f"--steps={steps}", f"--save_every_steps={every}", "--max_to_keep=100",
              *_VERIFIER_MODEL.value]
    alone = os.path.join(scratch, "verifier_alone")
    text = run([sys.executable, "-m", "trainer.train", f"--workdir={alone}", *common], f"{alone}.log")
    alone_sps = float(DONE.findall(text)[-1])
    ckpt = os.path.join(scratch, "verifier_run")
    dirs = str(step_dir(ckpt, 0).parent), str(verdict_file(ckpt, 0).parent)
    commits, verdicts, complete = {}, {}, {}
    with open(f"{ckpt}_verify.log", "w") as vlog, open(f"{ckpt}.log", "w") as tlog:
        trainer = subprocess.Popen([sys.executable, "-m", "trainer.train", f"--workdir={ckpt}", *common], cwd=ROOT,
                                   env=child_env(), stdout=tlog, stderr=subprocess.STDOUT, start_new_session=True)
        verify = [sys.executable, "-m", "verifier.verify", f"--workdir={ckpt}", f"--mesh=data={VERIFIER_CPU_DEVICES}",
                  "--follow", "--poll_secs=0.2"]
        verifier = subprocess.Popen(verify, cwd=ROOT, env=child_env(cpu=True), stdout=vlog, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.perf_counter() + _TIMEOUT.value
            while trainer.poll() is None and time.perf_counter() < deadline:
                scan(*dirs, commits, verdicts, complete)
                time.sleep(0.05)
            ended = time.perf_counter() + _VERIFIER_GRACE.value
            while verifier.poll() is None and time.perf_counter() < ended and set(commits) - set(complete):
                scan(*dirs, commits, verdicts, complete)
                time.sleep(0.05)
            scan(*dirs, commits, verdicts, complete)
        finally:
            for proc in (trainer, verifier):
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=60)
    text = open(f"{ckpt}.log").read()
    if trainer.returncode != 0 or not DONE.findall(text):
        raise RuntimeError(f"the verifier part's trainer exited {trainer.returncode}:\n{text[-3000:]}")
    with_verifier = float(DONE.findall(text)[-1])
    out = {"commits": len(commits), "complete": len(complete), "alone_steps_per_sec": alone_sps,
           "with_verifier_steps_per_sec": with_verifier,
           "statuses": {str(s): f"{v['level']} {v['status']}" for s, (_, v) in sorted(complete.items())},
           "verdicts": {str(s): v for s, (_, v) in sorted(complete.items())},
           "verifier_log_tail": open(f"{ckpt}_verify.log").read()[-4000:]}
    if commits:  # a final step without a complete verdict in the grace period: paced to the newest one that had
        out.update({k: v[0] for k, v in verifier_pace(commits, complete, with_verifier).items() if v})
    return out


def main(argv):
    del argv
    unknown = set(_PARTS.value) - set(PARTS)
    if unknown:
        raise ValueError(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    found = devices()
    mesh = f"data={found['count']}"
    logging.info("devices: %s", found)
    scratch = tempfile.mkdtemp(prefix="device_bench_", dir=_WORKDIR.value)
    results = {"devices": found, "command": " ".join(sys.argv)}
    started = time.perf_counter()
    try:
        if "checkpoint" in _PARTS.value:
            results["checkpoint"] = checkpoint_part(scratch)
        if "goodput" in _PARTS.value or "restart" in _PARTS.value:
            results["goodput"], results["restart"] = goodput_part(scratch, mesh, "restart" in _PARTS.value)
        if "verifier" in _PARTS.value:
            results["verifier"] = verifier_part(scratch, mesh)
    finally:
        results["wall_secs"] = time.perf_counter() - started
        if _JSON_OUT.value:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(results, f, indent=1, sort_keys=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(device_report.report(results, {"realistic": _REALISTIC.value, "write_bound": _WRITE_BOUND.value},
                               statistics.median))


if __name__ == "__main__":
    entry.run(main)
