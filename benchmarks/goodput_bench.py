"""Goodput under preemption, end to end: this trainer against plain Orbax, side by side.

  python -m benchmarks.goodput_bench [--steps=80] [--preemptions=2] [--seed=0] [--json_out=FILE]

Every variant trains the same mlp (sized so that one save takes about a second) for the same
number of steps on a 2-process local pod (`launch.local`, 1 CPU device each, data=2), one after
the other. A fixed, seeded schedule sends SIGTERM to one process of the running pod at given wall
times (offsets from the variant's start, drawn once from the ideal run's wall time); the benchmark
relaunches the pod at once, as a scheduler would, until it exits 0 (a SIGTERM scheduled after the
variant has finished is not sent).

  ideal                 no preemptions, no saves (benchmarks/plain_orbax_trainer.py --noplain_save)
  service               this trainer (checkpoint every --save_every_steps)
  plain_orbax           the same program, data and loop with a plain async ocp.CheckpointManager
  service_auto          this trainer with --save_every_secs=auto
  service_no_cache      `service` without the persistent compilation cache (restart latency only)
  service_no_probe      `service` without the cheap proof's probes (--probe_steps=0): what recording them costs
  service_local         `service` plus the local tier: --local_save_every_steps=--save_every_steps/5, to a
                        directory per process beside the workdir (the persistent cadence unchanged)
With --interruption=sigkill the schedule kills one process instead (a crash, a lost host): no save
is made at the interruption, so the steps since the newest complete save are recomputed.
With --persistent=gcs the trainer variants' workdirs are gs:// paths on a GCS-protocol server on
127.0.0.1 (tests/gcs_emulator.py, one request at a time: a slow, remote persistent store), while
the local tier stays on local disk.
An untimed warm-up run of the trainer fills the compilation cache first. --rounds repeats `ideal`
and every variant, in an order rotated each round; goodput is computed per round against that
round's ideal run, and the medians are reported. Before each run (untimed) the benchmark calls
os.sync() and waits --settle_secs, so that no run pays for the writes of the one before.

Per variant: goodput (the ideal wall time over this variant's, excluding nothing), steps recomputed
per preemption (the step the preempted pod reached minus the step the next one resumed), restart
latency (relaunch to the first step's loss, from the log's time stamp) and its split into the
trainer's `phase <name> <secs>s` lines (process start, distributed start-up, compile, restore, first
step), and the wall-time overhead per save ((wall - ideal wall - restart latencies) / saves of both
tiers). And the CPU each run's pods used (user and system, every process, from getrusage of the waited
children) with the cores it kept busy, and each service variant's CPU and wall time beyond plain Orbax's
run of the same round: on saturated cores, CPU spent is wall time lost. A markdown table on stdout;
--json_out writes the numbers. Every process is started in its
own group and killed by PID on any exit.
"""

import atexit
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
from absl import app, flags, logging

from benchmarks.common import ROOT, fresh_memory_fill_secs
from benchmarks.goodput_events import LogProgress, event_report
from benchmarks.goodput_report import cpu_report, fill_report, report, summarise, targets

STEPS = flags.DEFINE_integer("steps", 80, "Steps of every variant.", lower_bound=10)
SAVE_EVERY_STEPS = flags.DEFINE_integer("save_every_steps", 10, "Fixed save cadence (service, plain_orbax).")
PREEMPTIONS = flags.DEFINE_integer("preemptions", 2, "SIGTERMs per preempted variant.", lower_bound=0)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the preemption schedule.")
HIDDEN_DIM = flags.DEFINE_integer("hidden_dim", 1024, "mlp width and input features, or the transformer's d_model "
                                   "(sets the save size).")
MODEL = flags.DEFINE_enum("model", "mlp", ["mlp", "transformer"], "The trainer's --model (transformer: compiles "
                          "for longer, so a restart is mostly compilation without the cache).")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Global batch: sets a step's cost, not the save's.", lower_bound=2)
VARIANTS = flags.DEFINE_list("variants", ["service", "plain_orbax", "service_auto", "service_no_cache"],
                             "Variants to run after `ideal` (also: service_local, service_no_probe).")
ROUNDS = flags.DEFINE_integer("rounds", 8, "Rounds; each runs `ideal` and every variant once, in an order rotated "
                              "each round. Per-run ratios are medians over the rounds (8: single rounds spread by "
                              "5-20% on 2 cores, and the service / plain Orbax ratio must decide 2%).", lower_bound=1)
LOCAL_ROOT = flags.DEFINE_string("local_root", None, "service_local's local tier goes under a fresh directory here "
                                 "(e.g. /dev/shm, a RAM disk), removed at the end (default: beside the workdirs).")
SCHEDULE = flags.DEFINE_enum(
    "schedule", "step", ["step", "time"], "When the k-th interruption comes: once the running pod has logged a seeded "
    "step (every round and variant loses the same work and relaunches as often), or at a seeded wall time from the "
    "variant's start (drawn from the first ideal run: a slow ideal run or a fast variant can miss one).")
INTERRUPTION = flags.DEFINE_enum("interruption", "sigterm", ["sigterm", "sigkill"],
                                 "What the schedule sends one process: a preemption, or a crash.")
TIMEOUT_SECS = flags.DEFINE_float("timeout_secs", None, "The whole benchmark is stopped (every process killed) "
                                  "after this long (default: 90 s a run, ideal included, and 120 s for the warm-up).")
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the numbers as JSON here.")
PERSISTENT = flags.DEFINE_enum("persistent", "disk", ["disk", "gcs"],
                               "Where the trainer variants' workdirs are: local disk, or the GCS emulator.")
SETTLE_SECS = flags.DEFINE_float(
    "settle_secs", 3.0, "Before each timed run, untimed: os.sync() (the previous run's writes reach the disk "
    "now, not inside the next run) and this long a pause (its freed memory and background threads settle).",
    lower_bound=0.0)
WORKDIR = flags.DEFINE_string("workdir", None, "Keep the runs here (default: a temporary directory, removed); every "
                              "checkpoint is kept: about 0.9 GB a round at the defaults.")

# Every step's progress line stamps its end: the per-event costs come from them (goodput_events.py).
TRAIN = ["--mesh=data=2", "--num_layers=4", "--log_every_steps=1", "--max_to_keep=1000", "--lease_secs=5"]
_LIVE: set[int] = set()  # process groups still running, killed on any exit


def _kill_all(*_):
    for pgid in list(_LIVE):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _LIVE.discard(pgid)


_GCS_ENV: dict[str, str] = {}  # set by start_gcs_emulator: what points gcsfs and TensorStore at it
GCS_BUCKET = "goodput"


def start_gcs_emulator(log_path: str) -> None:
    """tests/gcs_emulator.py on a free port, in its own process group (killed by _kill_all)."""
    from tests import gcs_emulator

    proc, env = gcs_emulator.start(GCS_BUCKET, cwd=ROOT, output=open(log_path, "w"), new_session=True)
    _LIVE.add(proc.pid)
    _GCS_ENV.update(env)
    os.environ.update(_GCS_ENV)  # count_saves lists the bucket from this process


def trainer_workdir(root: str, variant: str) -> str:
    if PERSISTENT.value == "gcs" and variant not in ("ideal", "plain_orbax"):
        return f"gs://{GCS_BUCKET}/{os.path.basename(root)}-{variant}"
    return os.path.join(root, variant)


def variant_command(variant: str, workdir: str, cache_dir: str, local_prefix: str = "") -> tuple[str, list[str]]:
    sizes = [f"--model={MODEL.value}", f"--batch_size={BATCH_SIZE.value}", f"--hidden_dim={HIDDEN_DIM.value}"]
    if MODEL.value == "mlp":
        sizes.append(f"--input_dim={HIDDEN_DIM.value}")
    common = [f"--workdir={workdir}", f"--steps={STEPS.value}", *TRAIN, *sizes]
    cache = f"--compilation_cache_dir={'' if variant == 'service_no_cache' else cache_dir}"
    every = f"--save_every_steps={SAVE_EVERY_STEPS.value}"
    if variant == "ideal":
        return "benchmarks.plain_orbax_trainer", [*common, "--noplain_save", cache]
    if variant == "plain_orbax":
        return "benchmarks.plain_orbax_trainer", [*common, every, cache]
    if variant == "service_auto":
        return "trainer.train", [*common, "--save_every_secs=auto", cache]
    if variant == "warm_up":
        return "trainer.train", [*common[:1], f"--steps={SAVE_EVERY_STEPS.value}", *common[2:], every, cache]
    if variant in ("service", "service_no_cache"):
        return "trainer.train", [*common, every, cache]
    if variant == "service_no_probe":
        return "trainer.train", [*common, every, "--probe_steps=0", cache]
    if variant == "service_local":
        local = [f"--local_dir={local_prefix}-{{process}}",
                 f"--local_save_every_steps={max(SAVE_EVERY_STEPS.value // 5, 1)}"]
        return "trainer.train", [*common, every, *local, cache]
    raise ValueError(f"unknown variant {variant!r}")


def require_auto_interval() -> None:
    """service_auto needs --save_every_secs=auto; without it the variant fails instead of running something else."""
    help_text = subprocess.run([sys.executable, "-m", "trainer.train", "--helpfull"], cwd=ROOT, capture_output=True,
                               text=True, timeout=120).stdout
    if "'auto'" not in help_text:
        raise RuntimeError("service_auto: this trainer has no --save_every_secs=auto (issue 12 section 3)")


def launch(module: str, args: list[str], log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=1",
               f"--module={module}", "--", *args]
    python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=python_path, **_GCS_ENV)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    _LIVE.add(proc.pid)
    return proc


def interrupt_one(launcher: subprocess.Popen, process_id: int) -> bool:
    """--interruption's signal to one process of the pod (SIGTERM: a preemption; SIGKILL: a crash)."""
    try:
        children = psutil.Process(launcher.pid).children()
        targets = [c for c in children if f"--process_id={process_id}" in c.cmdline()]
    except psutil.Error:
        return False
    for target in targets:
        logging.info("%s to process %d (pid %d)", INTERRUPTION.value.upper(), process_id, target.pid)
        target.kill() if INTERRUPTION.value == "sigkill" else target.terminate()
    return bool(targets)


def run_variant(variant: str, root: str, cache_dir: str, schedule: list[tuple[float, int]], deadline: float,
                local_root: str = "") -> dict:
    workdir = trainer_workdir(root, variant)
    local_prefix = os.path.join(local_root or root, f"{os.path.basename(root)}-{variant}-local")
    module, args = variant_command(variant, workdir, cache_dir, local_prefix)
    settle()
    cpu_before = children_cpu_secs()
    begin, launches, pending = time.monotonic(), [], list(schedule)
    while True:
        log_path = os.path.join(root, f"{variant}-{len(launches)}.log")
        launched_at = time.time()
        proc = launch(module, args, log_path)
        progress = LogProgress(log_path)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{variant}: past the benchmark's --timeout_secs")
            due = pending and (progress.newest_step() >= pending[0][0] if SCHEDULE.value == "step"
                               else time.monotonic() - begin >= pending[0][0])
            if due:
                _, process_id = pending.pop(0)
                interrupt_one(proc, process_id)
            time.sleep(0.02)
        _LIVE.discard(proc.pid)
        launches.append((launched_at, open(log_path).read(), time.time()))
        logging.info("%s launch %d: exit %d after %.1fs", variant, len(launches) - 1, proc.returncode,
                     time.monotonic() - begin)
        if proc.returncode == 0:
            break
        if proc.returncode != 75 or len(launches) > len(schedule) + 2:
            raise RuntimeError(f"{variant}: pod exited {proc.returncode}; see {log_path}")
    return {**summarise(variant, time.monotonic() - begin, launches, workdir),
            "cpu_secs": children_cpu_secs() - cpu_before}


def children_cpu_secs() -> float:
    """User and system CPU of every process this one has waited for, their own children included: a run's
    pods (launch.local waits for its trainers, and this process for launch.local)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def settle() -> None:
    """Untimed, before every run: whatever the run before left pending is not charged to this one."""
    begin = time.monotonic()
    os.sync()
    logging.info("settle: os.sync() %.2fs, then %.1fs idle", time.monotonic() - begin, SETTLE_SECS.value)
    time.sleep(SETTLE_SECS.value)


def preemption_schedule(rng: random.Random, ideal_secs: float, count: int) -> list[tuple[float, int]]:
    """(when, process id) per interruption. --schedule=step: the k-th once step (k + 0.5 + U(0, 0.2)) / (count +
    0.5) x --steps is logged; --schedule=time: at (0.3 + 0.7 k + U(0, 0.1)) x the ideal wall time from the
    variant's start. Far enough apart that each lands in training rather than in the previous restart."""
    if SCHEDULE.value == "step":
        return [(int(STEPS.value * (k + 0.5 + rng.uniform(0.0, 0.2)) / (count + 0.5)), rng.choice([0, 1]))
                for k in range(count)]
    return [(ideal_secs * (0.3 + 0.7 * k + rng.uniform(0.0, 0.1)), rng.choice([0, 1])) for k in range(count)]


def main(argv: list[str]) -> None:
    atexit.register(_kill_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # atexit then kills every pod
    timeout = TIMEOUT_SECS.value or 90.0 * ROUNDS.value * (len(VARIANTS.value) + 1) + 120.0
    deadline = time.monotonic() + timeout
    root = WORKDIR.value or tempfile.mkdtemp(prefix="goodput-")
    os.makedirs(root, exist_ok=True)
    cache_dir = os.path.join(root, "compile-cache")
    if "service_auto" in VARIANTS.value:
        require_auto_interval()
    local_root = tempfile.mkdtemp(prefix="goodput-local-", dir=LOCAL_ROOT.value) if LOCAL_ROOT.value else ""
    rounds, schedule, fills = [], [], []
    try:
        if PERSISTENT.value == "gcs":
            start_gcs_emulator(os.path.join(root, "gcs-emulator.log"))
        # Untimed: fills the compilation cache (step, batch, init and the service's fingerprint
        # functions), so that no variant's first launch pays a cold compile the others do not.
        run_variant("warm_up", root, cache_dir, [], deadline)
        for round_ in range(ROUNDS.value):
            round_root = os.path.join(root, f"round{round_}")
            os.makedirs(round_root)
            fills.append(fresh_memory_fill_secs())  # the machine's state at the round's start (common.py)
            results = {"ideal": run_variant("ideal", round_root, cache_dir, [], deadline)}
            if not schedule:  # drawn once, from the first ideal run: every round and variant gets the same
                schedule = preemption_schedule(random.Random(SEED.value), results["ideal"]["wall_secs"],
                                               PREEMPTIONS.value)
                logging.info("preemption schedule (%s, process): %s",
                             "steps" if SCHEDULE.value == "step" else "secs from each variant's start",
                             [(round(t, 1), p) for t, p in schedule])
            shift = round_ % len(VARIANTS.value)
            for variant in VARIANTS.value[shift:] + VARIANTS.value[:shift]:
                results[variant] = run_variant(variant, round_root, cache_dir, schedule, deadline, local_root)
            rounds.append({name: results[name] for name in ["ideal", *VARIANTS.value]})
    finally:
        _kill_all()
        if not WORKDIR.value:
            shutil.rmtree(root, ignore_errors=True)
        if local_root:
            shutil.rmtree(local_root, ignore_errors=True)
    table, out = report(rounds)
    events_table, events = event_report(rounds)
    out.update(events)
    table += "\n\nPer-event costs, measured within each launch (benchmarks/goodput_events.py):\n\n" + events_table
    table += "\n\n" + cpu_report(rounds, out) + "\n\n" + fill_report(fills, out)
    out["schedule"], out["fresh_memory_fill_secs_per_round"] = schedule, fills
    out["load_average"] = os.getloadavg()
    out["rounds"] = rounds  # every launch's events and phases: the report can be recomputed from the JSON
    sys.stdout.write(table + "\n\n" + "\n".join(targets(out)) + "\n")
    if JSON_OUT.value:
        with open(JSON_OUT.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
