"""Where a save's cost goes: each step's wall time around every save, the service against plain Orbax.

  python -m benchmarks.save_cost_trace [--steps=120 --every=20] [--json_out=FILE]

Both trainers run the same model with `--log_every_steps=1`, so every step's loss reaches the host and the
gap between two step lines is that step's whole cost on the host's clock (dispatch, compute, and whatever a
save, a probe or a summary added to it). The rows are offsets from a save's step (0 is the step that hands
the state off), averaged over the saves before the final one; `extra` is the service's time minus plain
Orbax's at that offset. With a step's line every step both trainers pay a host sync per step, so compare the
columns with each other, not with the goodput benchmark's steps/s. Each child is killed by PID on timeout.
"""

import datetime
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

from absl import flags

from benchmarks import device_bench
from runtime import entry

_STEPS = flags.DEFINE_integer("steps", 120, "Steps each trainer runs.")
_EVERY = flags.DEFINE_integer("every", 20, "A save every this many steps.")
_OFFSETS = flags.DEFINE_integer("offsets", 8, "Offsets after a save to tabulate (the probe takes 4).")
_OUT = device_bench._JSON_OUT  # --json_out: also write the per-step times here as JSON

STEP_LINE = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] step (\d+) loss ", re.M)
VARIANTS = {"plain_orbax": ["benchmarks.plain_orbax_trainer"], "service": ["trainer.train"]}


def step_secs(log_text: str) -> dict[int, float]:
    """{step: seconds since the previous step's line} from absl's timestamps."""
    stamps = {}
    for _, clock, step in STEP_LINE.findall(log_text):
        stamps[int(step)] = datetime.datetime.strptime(clock, "%H:%M:%S.%f")
    return {s: (stamps[s] - stamps[s - 1]).total_seconds() for s in sorted(stamps) if s - 1 in stamps}


def by_offset(secs: dict[int, float], every: int, steps: int, offsets: int) -> dict[int, float]:
    """The median time of the steps `offset` after each save, saves before the final one; -1 is a plain step."""
    saves = range(every, steps, every)
    table = {o: statistics.median(secs[s + o] for s in saves if s + o in secs) for o in range(offsets)}
    quiet = [t for s, t in secs.items() if s % every >= offsets and s > every]
    table[-1] = statistics.median(quiet) if quiet else float("nan")
    return table


def main(argv):
    del argv
    mesh = f"data={device_bench.devices()['count']}"
    scratch = tempfile.mkdtemp(prefix="save_cost_")
    rows, raw = {}, {}
    try:
        for variant, (module, *extra) in VARIANTS.items():
            workdir = os.path.join(scratch, variant)
            text = device_bench.run(
                [sys.executable, "-m", module, f"--workdir={workdir}", f"--mesh={mesh}", f"--steps={_STEPS.value}",
                 f"--save_every_steps={_EVERY.value}", "--log_every_steps=1", *device_bench._MODEL.value, *extra],
                f"{workdir}.log")
            raw[variant] = step_secs(text)
            rows[variant] = by_offset(raw[variant], _EVERY.value, _STEPS.value, _OFFSETS.value)
            raw[variant + "_handed_off"] = [float(x) for x in device_bench.HANDED_OFF.findall(text)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("| offset from a save | plain Orbax s | service s | extra s |\n|---|---|---|---|")
    for offset in [*range(_OFFSETS.value), -1]:
        plain, service = rows["plain_orbax"][offset], rows["service"][offset]
        name = "a step far from saves" if offset == -1 else str(offset)
        print(f"| {name} | {plain:.4f} | {service:.4f} | {service - plain:+.4f} |")
    per_save = sum(rows["service"][o] - rows["plain_orbax"][o] for o in range(_OFFSETS.value))
    print(f"\nper save, the service's extra over offsets 0..{_OFFSETS.value - 1}: {per_save:+.3f} s")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({"rows": rows, "raw": raw}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    entry.run(main)
