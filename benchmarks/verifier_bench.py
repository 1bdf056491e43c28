"""Verifier benchmark: how soon the verifier proves a step, and what it costs training, as ratios.

The real trainer (`python -m trainer.train`, mlp, data=4,model=2 over 8 fake CPU devices, params +
two Adam moments >= 256 MiB) runs as a subprocess, alone or with the real verifier following it
(`python -m verifier.verify --follow --mesh=<--verifier_mesh>`, by default data=4,model=2 on 8 fake CPU
devices of its own, its fallback backoff 0.1-0.5s),
one verifier variant per --verify_budgets value: 0, the cheap proof at every save (a few steps replayed from
it against the trainer's probe; the full proof at the final step only), and 1, the full proof of every
interval too:

  1. verdict latency: from a step's commit (this process polls every 5 ms for the step's directory,
     `<workdir>/checkpoints/<step>`, which Orbax renames from `<step>.orbax-checkpoint-tmp-*`) to
     its first verdict (`verdicts/<step>.json` appearing: the intact proof, written before the
     replay) and to its complete verdict (reproduced, after the replay from its predecessor),
     over a plain restore of the same steps
     (`CheckpointService(workdir, read_only=True).restore(step, abstract_state)` onto the verifier's
     mesh, in a subprocess with its devices, after training, warm-up restore excluded). Each run's first step
     (verifier start-up, compiles) is left out.                                  target <= 1.5
     Also the verifier's own restore time (the verdict's durations_secs) over the plain one.
  2. trainer steps/s (its `done:` line) with the verifier following, over steps/s alone. The
     verifier competes for the same CPU cores, so this is reported, not judged.
  3. the verifier's pace, from the first commit to the final step's complete verdict: the trainer's
     steps it proved per second, and the steps it replayed per second (its compute), each over the
     trainer's steps/s (benchmarks/verifier_pace.py).

Only ratios are judged; both sides come from the same run. Each round runs every variant in an
order rotated each round, after a sync; every ratio is a ratio of medians. Subprocesses are killed
by PID when their run ends, fails or times out; each run's workdir is deleted after it, but the
newest verifier run's (the restore baseline reads it). A run that leaves a step without a passing
complete verdict stops the benchmark with one line per such step, and keeps that run's logs, verdicts
and probes (benchmarks/verifier_scan.py). The header gives other processes' CPU use.

  PYTHONPATH=. .venv/bin/python -m benchmarks.verifier_bench [--rounds=2] [--steps=80] [--workdir=/tmp]
"""

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging

from benchmarks.verifier_pace import LEVELS, ratios, verifier_pace
from benchmarks.verifier_scan import keep_for_diagnosis, scan, unproved
from checkpointing._src.workdir import step_dir, verdict_file  # the workdir's layout, named once

_STEPS = flags.DEFINE_integer("steps", 80, "Training steps per run (80: ten commits, most of them after the "
                              "verifier's memory stopped growing).")
_SAVE_EVERY = flags.DEFINE_integer("save_every_steps", 8, "Checkpoint interval (steps).")
_HIDDEN = flags.DEFINE_integer("hidden_dim", 2752, "mlp hidden width (the state must be >= --min_state_mib).")
_MIN_STATE = flags.DEFINE_float("min_state_mib", 256, "Refuse a smaller state: below it a restore measures start-up "
                                "more than reading (0: a smoke run of every code path, tests/test_benchmarks.py).",
                                lower_bound=0)
_LAYERS = flags.DEFINE_integer("num_layers", 4, "mlp hidden layers.")
# The mlp's default 16 features: its cross-layout tolerance was measured there. With 1024 (targets
# sums of 1024 features, first losses near 8e6) the run diverges across layouts beyond it.
_INPUT = flags.DEFINE_integer("input_dim", 16, "mlp input features.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Global batch size.")
# The recording layout by default (a proof there is bit-exact, one replay); another, e.g. data=8, measures what
# proofs across layouts cost: a second replay on the verifier's other layout ('B' variants) against the
# declared bounds alone ('B/declared'; this width drifts past the mlp's declared 1e-5 on data=2 from step 32).
# The verifier is still its own process on its own devices.
_VERIFIER_MESH = flags.DEFINE_string("verifier_mesh", "data=4,model=2", "The verifier's (and the plain restore's) "
                                     "mesh; its device count is the product of the sizes.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds; each runs every variant once.")
_BUDGETS = flags.DEFINE_list("verify_budgets", ["0", "1"], "Verifier --verify_budget values, one variant each: 0 the "
                              "cheap proof at every save (the full one at the final step only), 1 the full proof "
                              "of every interval (and the cheap one); 'B/declared': the same with "
                              "--measure_noise=false (across layouts one replay judged by the model's declared "
                              "bounds, as the proofs were before the noise was measured).")
_REPLAY = flags.DEFINE_integer("replay_steps", 100, "The verifier's --replay_steps in every variant.", lower_bound=0)
_VERIFIER_CORES = flags.DEFINE_list("verifier_cores", [], "CPUs for the verifier and the plain restore, the trainer "
                                    "taking the others (1 on 2 cores): what sharing the cores costs. Default: "
                                    "every process may run on every core.")
_VERIFIER_V = flags.DEFINE_integer("verifier_v", 0, "The verifier's absl --v: 1 logs each replayed step, forecast "
                                   "wait and verdict written, with its time, to its log (kept when a run fails).")
_RESTORE_REPEATS = flags.DEFINE_integer("restore_repeats", 3, "Plain restores of each measured step.")
_RUN_TIMEOUT = flags.DEFINE_float("run_timeout_secs", 600, "Kill a run's processes after this long.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Makes a fresh temp dir under this (default: $TMPDIR, else /tmp), "
                               "deleted at the end.")
_RESTORE_CHILD = flags.DEFINE_string("restore_child", None, "Internal: time plain restores of this workdir.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the ratios as a JSON object to this file.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DONE = re.compile(r"done: steps \d+\.\.\d+, final loss \S+, ([\d.]+) steps/s")


def verifier_mesh() -> tuple[tuple[str, int], ...]:
    return tuple((name, int(size)) for name, size in (axis.split("=") for axis in _VERIFIER_MESH.value.split(",")))


def verifier_devices() -> int:
    return math.prod(size for _, size in verifier_mesh())


def env(devices: int) -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    flags_ = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path, XLA_FLAGS=flags_)


def pinned(name: str):
    """A Popen preexec_fn that pins the process to its share of --verifier_cores, or None."""
    if not _VERIFIER_CORES.value:
        return None
    verifier = {int(core) for core in _VERIFIER_CORES.value}
    cores = verifier if name in ("verify", "restore") else set(range(os.cpu_count())) - verifier
    return lambda: os.sched_setaffinity(0, cores)


def state_mib(h: int) -> float:
    """float32 params (Dense input->h, (L-1) x h->h, h->1, with biases) and two Adam moments."""
    return 3 * 4 * ((_INPUT.value + 1) * h + (_LAYERS.value - 1) * (h + 1) * h + h + 1) / 2**20


def other_cpu_secs() -> float:
    """CPU seconds the whole machine was busy (incl. steal), less this process's and its reaped children's."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK") - sum(os.times()[:4])


def run_once(run_dir: str, budget: str | None) -> dict:
    """One training run, with a following verifier of --verify_budget=`budget` unless it is None."""
    ckpt = os.path.join(run_dir, "ckpt")
    os.makedirs(ckpt)
    train = [sys.executable, "-m", "trainer.train", f"--workdir={ckpt}", "--model=mlp", "--mesh=data=4,model=2",
             f"--hidden_dim={_HIDDEN.value}", f"--num_layers={_LAYERS.value}", f"--input_dim={_INPUT.value}",
             f"--batch_size={_BATCH.value}", f"--steps={_STEPS.value}", f"--save_every_steps={_SAVE_EVERY.value}",
             "--max_to_keep=100"]
    verify = [sys.executable, "-m", "verifier.verify", f"--workdir={ckpt}", f"--mesh={_VERIFIER_MESH.value}",
              "--follow", "--poll_secs=0.1", "--max_poll_secs=0.5", f"--replay_steps={_REPLAY.value}",
              f"--verify_budget={str(budget).split('/')[0]}", f"--v={_VERIFIER_V.value}",
              f"--measure_noise={not str(budget).endswith('/declared')}"]
    commits, verdicts, complete, procs = {}, {}, {}, {}
    dirs = str(step_dir(ckpt, 0).parent), str(verdict_file(ckpt, 0).parent)  # '<step>', '<step>.json' inside
    try:  # the verifier first, so that it is polling by the first commit
        for name, command, devices in ([("verify", verify, verifier_devices())] if budget is not None else []) + \
                [("train", train, 8)]:
            with open(os.path.join(run_dir, f"{name}.log"), "w") as log:
                procs[name] = subprocess.Popen(command, cwd=ROOT, env=env(devices), stdout=log,
                                               stderr=subprocess.STDOUT, preexec_fn=pinned(name))
        deadline = time.perf_counter() + _RUN_TIMEOUT.value
        while any(p.poll() is None for p in procs.values()) and procs["train"].poll() in (None, 0):
            scan(*dirs, commits, verdicts, complete)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"run in {run_dir} still going after {_RUN_TIMEOUT.value}s")
            time.sleep(0.005)
        scan(*dirs, commits, verdicts, complete)
    finally:
        for p in procs.values():
            p.kill()  # by PID; a no-op for one that has exited and been reaped
        for p in procs.values():
            p.wait(timeout=60)
    logs = {name: open(os.path.join(run_dir, f"{name}.log")).read() for name in procs}
    # Declared bounds may condemn a genuine step (what measuring the noise fixed): counted, not a stop.
    declared = str(budget).endswith("/declared")
    for name in sorted(procs, key=lambda name: name != "train"):  # the trainer's failure is the cause
        if procs[name].returncode not in ((0, 1) if declared and name == "verify" else (0,)):
            raise RuntimeError(f"{name} exited {procs[name].returncode}; log tail:\n{logs[name][-3000:]}")
    steps_per_sec = float(DONE.findall(logs["train"])[-1])
    problems = unproved(commits, verdicts, complete) if budget is not None and not declared else []
    if len(commits) < 2 or problems:
        kept = keep_for_diagnosis(run_dir, ckpt, _WORKDIR.value or tempfile.gettempdir())
        raise RuntimeError(f"run {run_dir}: {len(commits)} commits; {'; '.join(problems) or 'too few commits'} "
                           f"(its logs, verdicts and probes are kept in {kept})")
    logging.info("run %s: %.3f steps/s, commit->verdict %s", run_dir, steps_per_sec,
                 {s: round(verdicts[s][0] - commits[s], 2) for s in commits if s in verdicts})
    steps = [s for s in sorted(commits)[1:] if s in complete]  # the first carries start-up and compiles
    out = {"steps_per_sec": [steps_per_sec], "latency": [verdicts[s][0] - commits[s] for s in steps],
           "complete_latency": [complete[s][0] - commits[s] for s in steps],
           "verifier_restore": [complete[s][1]["durations_secs"]["restore"] for s in steps],
           "levels": [complete[s][1]["level"] for s in steps],
           "failed": [sum(complete[s][1]["status"] == "fail" for s in complete)]}
    if budget is not None:
        out.update(verifier_pace(commits, complete, steps_per_sec))
    return out


def _median_secs(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}s" if values else "none (no final verdict in time)"


def restore_child(workdir: str) -> None:
    """In a subprocess with the verifier's devices: times plain restores of every step but the first (the warm-up)."""
    import dataclasses, gc, jax  # noqa: E401 (only this child imports jax)
    from checkpointing._src.service import CheckpointService
    from checkpointing._src.workdir import committed_steps, read_manifest
    from trainer import model_config
    from trainer.program import build_mesh, build_program, validate
    steps = committed_steps(workdir)
    config = model_config.from_json(read_manifest(workdir, steps[0])["config"])
    config = validate(dataclasses.replace(config, workdir=workdir, mesh=verifier_mesh()), jax.device_count())
    program = build_program(config, build_mesh(config))
    service, times = CheckpointService(workdir, read_only=True), []
    for repeat in range(-1, _RESTORE_REPEATS.value):
        for step in steps[:1] if repeat < 0 else steps[1:]:
            gc.collect()
            started = time.perf_counter()
            state = jax.block_until_ready(service.restore(step, program.abstract_state).state)
            times += [time.perf_counter() - started] if repeat >= 0 else []
            del state
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(program.abstract_state))
    print("RESTORE " + json.dumps({"bytes": nbytes, "times": times}))


def plain_restores(workdir: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.verifier_bench", f"--restore_child={workdir}",
                           f"--restore_repeats={_RESTORE_REPEATS.value}", f"--verifier_mesh={_VERIFIER_MESH.value}"],
                          cwd=ROOT, env=env(verifier_devices()), capture_output=True, preexec_fn=pinned("restore"),
                          text=True, timeout=_RUN_TIMEOUT.value)  # run() kills the child by PID on a timeout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESTORE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"restore child exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESTORE "):])


def report(results: dict, restore: dict, other: tuple) -> str:
    def raw(name, values, unit):
        return f"{name} {statistics.median(values):.3f}{unit} [" + ", ".join(f"{v:.3f}" for v in values) + "]"

    def row(label, num, den, target=None, unit="s"):
        value = statistics.median(num[1]) / statistics.median(den[1])
        met = "n/a" if target is None else ("yes" if value <= target else "NO")
        return (f"| {label} | {value:.3f} | {'-' if target is None else f'<= {target:.2f}'} | {met} | "
                f"{raw(*num, unit)} | {raw(*den, unit)} |")

    def gather(variant, key):
        return [x for run in results[variant] for x in run[key]]

    plain = ("restore", restore["times"])
    cores = (f"The verifier and the plain restore on CPU {','.join(_VERIFIER_CORES.value)}, the trainer on the others. "
             if _VERIFIER_CORES.value else "")
    lines = [f"Verifier benchmark: mlp state of {restore['bytes'] / 2**20:.1f} MiB (params + 2 Adam moments), "
             f"trainer on data=4,model=2 (8 CPU devices), verifier on {_VERIFIER_MESH.value} "
             f"({verifier_devices()} CPU devices of its own, --replay_steps={_REPLAY.value}); {_STEPS.value} steps "
             f"saving every {_SAVE_EVERY.value}; medians over {_ROUNDS.value} rounds (variants rotated), raw values in "
             f"brackets. Latencies leave out each run's first step. {cores}Other processes used {other[0]:.0f} CPU-s "
             f"in the {other[1]:.0f}s it ran ({other[0] / other[1] / os.cpu_count():.1%} of {os.cpu_count()} cores).",
             "",
             "| ratio | value | target | met | numerator | denominator |", "|---|---|---|---|---|---|"]
    budgets = _BUDGETS.value
    lines += [row(f"commit -> first verdict (verify_budget={b}) / plain restore",
                  ("latency", gather(b, "latency")), plain, 1.5) for b in budgets]
    lines += [row(f"commit -> complete verdict (verify_budget={b}) / plain restore",
                  ("latency", gather(b, "complete_latency")), plain) for b in budgets]
    lines += [row(f"verifier's own restore (verify_budget={b}) / plain restore",
                  ("verdict restore", gather(b, "verifier_restore")), plain) for b in budgets]
    lines += [row(f"trainer steps proved per second (verify_budget={b}) / trainer steps/s",
                  ("proved", gather(b, "proved_steps_per_sec")), ("trained", gather(b, "train_steps_per_sec")),
                  unit=" steps/s") for b in budgets]
    lines += [row(f"verifier's replayed steps per second (verify_budget={b}) / trainer steps/s",
                  ("replayed", gather(b, "replayed_steps_per_sec")), ("trained", gather(b, "train_steps_per_sec")),
                  unit=" steps/s") for b in budgets]
    lines += [row(f"training steps/s with verifier (verify_budget={b}) / alone", ("with", gather(b, "steps_per_sec")),
                  ("alone", gather(None, "steps_per_sec")), unit=" steps/s") for b in budgets]
    lines += [""] + [f"verify_budget={b}: complete verdicts {', '.join(f'{levels.count(lv)} {lv}' for lv in LEVELS)} "
                     f"({sum(gather(b, 'failed'))} failed); "
                     f"steps replayed / steps trained {statistics.median(gather(b, 'replayed_over_trained')):.2f}; "
                     f"final commit -> its complete verdict {_median_secs(gather(b, 'final_lag_secs'))}."
                     for b in budgets for levels in [gather(b, "levels")]]
    return "\n".join(lines)


def main(argv):
    del argv
    if _RESTORE_CHILD.value:
        return restore_child(_RESTORE_CHILD.value)
    if state_mib(_HIDDEN.value) < _MIN_STATE.value:
        raise app.UsageError(f"the state is {state_mib(_HIDDEN.value):.1f} MiB, below --min_state_mib="
                             f"{_MIN_STATE.value:g}: raise --hidden_dim")
    root = tempfile.mkdtemp(prefix="verifier_bench_", dir=_WORKDIR.value or tempfile.gettempdir())
    variants = [None] + _BUDGETS.value
    results, keep, other, started = {variant: [] for variant in variants}, None, other_cpu_secs(), time.time()
    try:
        logging.info("state %.1f MiB; workdir %s", state_mib(_HIDDEN.value), root)
        for round_ in range(_ROUNDS.value):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                os.sync()
                run_dir = os.path.join(root, f"round{round_}_{'alone' if variant is None else 'budget' + variant}")
                results[variant].append(run_once(run_dir, variant))
                if variant is not None:  # keep the newest verifier run's checkpoints for the restore baseline
                    keep, run_dir = run_dir, keep
                if run_dir:
                    shutil.rmtree(run_dir)
        os.sync()
        restore = plain_restores(os.path.join(keep, "ckpt"))
        print(report(results, restore, (other_cpu_secs() - other, time.time() - started)))
        if _JSON_OUT.value:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(ratios(results, restore, _BUDGETS.value), f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
