"""Checkpoint benchmark: the service's costs as ratios against plain Orbax, measured in one run.

A random float32 state (--array_mib arrays, 128 MiB, plus an int32 scalar 'step', `--state_gib` in all), fully
sharded over a data=4,model=2 mesh of 8 fake CPU devices (no replicas, so every variant moves
exactly the state's bytes). Each variant runs in a fresh process of its own (benchmarks/checkpoint_child.py,
its state made by benchmarks.checkpoint_state), so none sees another's memory; inside it, its cases run in
rounds (one unmeasured, then --samples measured, in an order rotated each round), so the two
sides of a ratio are measured seconds apart; the variants run in an order rotated each repeat:

  saves     sync_save: the service with async_save=False, save + wait;
            async_marked_save: the service as Checkpointer.on_step runs it at a step-cadence save:
            the fingerprints came with the state (checkpointing/_src/marking.py: on_step dispatches them
            as the state comes in; computed before the clock starts, as the step is), so save()
            dispatches nothing: save() blocking, save + wait until committed;
            async_save: the service dispatching the fingerprint pass itself (a time-based or
            preemption save): the same, and what save() spent its blocking time in (probed calls);
            orbax_save: plain Orbax, ocp.CheckpointManager(dir) (async by default), StandardSave:
            save() blocking, save + wait; orbax_two_items_save: the same with the service's
            two items (the state and a JSON manifest without fingerprints)
  passes    fingerprint_pass: the pass as save() runs it (tree_fingerprints, then to_ints), and
            state_read: one read of the state (a jitted sum over every leaf) as its reference;
            marked_step / plain_step: a step writing every leaf (x + 1), then its output's marks
            (fingerprints) as on_step dispatches them, and the step alone: what the marks add to
            a loop at a save step
  restores  service.restore onto the saved layout, data=8 and model=8, and the time its
            fingerprint check took (checks.check_fingerprints, as the service calls it); each
            layout's save marks compiled first, untimed, as Checkpointer.prepare does before a restore
  rss_*     peak host RSS above the live state (VmHWM, reset through /proc/self/clear_refs)
            during a service save, a plain Orbax save and a restore, once each, unwarmed

Only ratios are judged (every one is a ratio of medians), never absolute times; the header says
how busy the rest of the machine was. Nothing is a test threshold: this prints what it measured,
and --json_out writes the same numbers as data.

  PYTHONPATH=. .venv/bin/python -m benchmarks.checkpoint_bench [--state_gib=1] [--repeats=2] [--samples=3] \
      [--array_mib=128] [--json_out=FILE] [--workdir=/tmp]
"""

import collections
import json
import os
import shutil
import statistics
import sys
import tempfile

from absl import flags, logging

from benchmarks import common
from runtime import entry

TIMED_VARIANTS = ("saves", "passes", "restores")
_STATE_GIB = flags.DEFINE_float("state_gib", 1.0, "Size of the float32 state, GiB (--array_mib arrays).",
                                lower_bound=1 / 1024)
_ARRAY_MIB = flags.DEFINE_integer("array_mib", 128, "Size of each array, MiB (1 with a tiny --state_gib: a smoke "
                                  "run of every code path, tests/test_benchmarks.py).", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Rounds of processes (each runs every timed variant once).",
                                lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples", 3, "Measured rounds of each variant's cases per process.", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "A fresh temporary directory is made under this "
                               "(default: $TMPDIR, else /tmp) and deleted at the end.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results to this file as JSON.")
_VARIANTS = flags.DEFINE_list("variants", list(TIMED_VARIANTS), "Timed variants to run (the RSS ones run only "
                              "with all three); the ratios of the others' cases are left out.")
_PIN_CALLER = flags.DEFINE_boolean("pin_caller", False, "Each variant's calling thread on a core of its own, every "
                                   "other thread on the others (benchmarks/checkpoint_child.py --pin_caller).")
_CHILD_TIMEOUT = flags.DEFINE_float("child_timeout_secs", 900, "Kill a variant's process after this long.")

CHILD = "benchmarks.checkpoint_child"  # not imported here: it imports JAX and defines the same flags
RSS = ["rss_service_save", "rss_orbax_save", "rss_restore"]  # in order: the first writes the restore source

# key -> (label, numerator (case, value), denominator (case, value), target or None)
RATIOS = {
    "blocking_over_plain_orbax_blocking": ("async save() blocking, fingerprints from the step / plain Orbax "
                                           "async save() blocking", ("async_marked_save", "blocking"),
                                           ("orbax_save", "blocking"), 1.2),
    "unmarked_blocking_over_plain_orbax_blocking": (
        "async save() blocking, save() dispatching the fingerprints / plain Orbax async save() blocking",
        ("async_save", "blocking"), ("orbax_save", "blocking"), None),
    "marked_step_over_plain_step": ("a step and its output's marks / the step alone",
                                    ("marked_step", "secs"), ("plain_step", "secs"), None),
    "async_blocking_over_sync_save": ("async save() blocking, fingerprints from the step / sync save + wait",
                                      ("async_marked_save", "blocking"), ("sync_save", "total"), 0.05),
    "service_save_over_plain_orbax": ("service save + wait, fingerprints from the step / plain Orbax save + wait",
                                      ("async_marked_save", "total"), ("orbax_save", "total"), 1.10),
    "unmarked_save_over_plain_orbax": ("service save + wait, save() dispatching the fingerprints / plain Orbax "
                                       "save + wait", ("async_save", "total"), ("orbax_save", "total"), None),
    "blocking_over_plain_orbax_two_items_blocking": (
        "async save() blocking / plain Orbax blocking, saving the same two items", ("async_save", "blocking"),
        ("orbax_two_items_save", "blocking"), None),
    "service_save_over_plain_orbax_two_items": (
        "service save + wait / plain Orbax save + wait, saving the same two items", ("async_save", "total"),
        ("orbax_two_items_save", "total"), None),
    "fingerprint_over_state_read": ("fingerprint pass / one read of the state",
                                    ("fingerprint_pass", "secs"), ("state_read", "secs"), None),
    "content_digests_over_state_read": ("content digests (sha256 of every leaf, a proving verdict's) / one read of "
                                        "the state", ("content_digests", "secs"), ("state_read", "secs"), None),
    "restore_data8_over_same": ("restore onto data=8 / onto the saved layout",
                                ("restore[data=8]", "restore"), ("restore[same]", "restore"), None),
    "restore_model8_over_same": ("restore onto model=8 / onto the saved layout",
                                 ("restore[model=8]", "restore"), ("restore[same]", "restore"), None),
    "restore_fingerprint_check_over_restore": ("fingerprint check in restore() / that restore",
                                               ("restore[same]", "fingerprint_check"),
                                               ("restore[same]", "restore"), None),
}
RSS_KEYS = {"peak_rss_save_over_state": ("service async save + wait", "rss_service_save", 1.3),
            "peak_rss_plain_orbax_save_over_state": ("plain Orbax async save + wait", "rss_orbax_save", None),
            "peak_rss_restore_over_state": ("service restore", "rss_restore", None)}


def run_variant(name: str, root: str, samples: dict[str, list]) -> None:
    """Runs one variant's process and adds its samples ({"<case>.<value>": [...]}) to `samples`."""
    result = common.run_child(CHILD, [f"--variant={name}", f"--state_gib={_STATE_GIB.value}",
                                      f"--array_mib={_ARRAY_MIB.value}", f"--root={root}",
                                      f"--samples={_SAMPLES.value}", f"--pin_caller={_PIN_CALLER.value}"],
                              timeout_secs=_CHILD_TIMEOUT.value)
    for key, values in result.items():
        samples[key if "." in key or key == "state_bytes" else f"{name}.{key}"] += values
    logging.info("%s: %s", name, " ".join(f"{k}={statistics.median(v):.4g}" for k, v in result.items()))


def measure(root: str) -> dict[str, list]:
    samples, timed = collections.defaultdict(list), _VARIANTS.value
    if set(TIMED_VARIANTS) <= set(timed):  # the restores read what rss_service_save writes
        for name in RSS:
            run_variant(name, root, samples)
    for repeat in range(_REPEATS.value):
        shift = repeat % len(timed)
        for name in timed[shift:] + timed[:shift]:
            run_variant(name, root, samples)
    return samples


def summarize(samples: dict[str, list]) -> dict:
    def median(case, value):
        return statistics.median(samples[f"{case}.{value}"])

    state_bytes = samples["state_bytes"][0]
    state_gib = state_bytes / 2**30
    have = lambda case, value: bool(samples.get(f"{case}.{value}"))  # a variant left out by --variants
    summary = {key: median(*num) / median(*den) for key, (_, num, den, _) in RATIOS.items()
               if have(*num) and have(*den)}
    if have("fingerprint_pass", "secs"):
        summary["fingerprint_secs_per_gib"] = median("fingerprint_pass", "secs") / state_gib
        summary["state_read_secs_per_gib"] = median("state_read", "secs") / state_gib
    for key, (_, variant, _) in RSS_KEYS.items():
        if have(variant, "extra_bytes"):
            summary[key] = median(variant, "extra_bytes") / state_bytes
    parts = [key.split(":", 1)[1] for key in samples if key.startswith("async_save.part:")]
    summary["blocking_parts_secs"] = {part: median("async_save", f"part:{part}") for part in parts}
    top_level = [samples[f"async_save.part:{part}"] for part in parts if "/" not in part]  # '/': inside another
    if parts:  # the saves variant ran (--variants)
        summary["blocking_parts_secs"]["python_and_other"] = statistics.median(
            blocking - sum(part) for blocking, *part in zip(samples["async_save.blocking"], *top_level))
    summary["medians_secs"] = {key: statistics.median(values) for key, values in samples.items()
                               if ":" not in key and not key.startswith("rss_") and key != "state_bytes"}
    summary["state_bytes"], summary["state_gib"] = state_bytes, state_gib
    return summary


def report(summary: dict, samples: dict, load: dict) -> str:
    def raw(case, value):
        return ", ".join(f"{x:.3f}" for x in samples[f"{case}.{value}"])

    lines = [f"Checkpoint benchmark: {summary['state_gib']:g} GiB float32 state on 8 CPU devices, each variant "
             f"in its own process; medians of {_REPEATS.value} x {_SAMPLES.value} interleaved samples (raw seconds "
             f"in brackets). Other processes used {load['other_cores']:.2f} cores meanwhile (load average "
             f"{load['load_average_at_start'][0]:.2f} at the start, {load['load_average_at_end'][0]:.2f} at the end).",
             "",
             "| key | ratio | value | target | numerator | denominator |", "|---|---|---|---|---|---|"]
    for key, (label, num, den, target) in RATIOS.items():
        if key not in summary:
            continue
        met = "reported" if target is None else f"<= {target:g} {'met' if summary[key] <= target else 'MISSED'}"
        lines.append(f"| `{key}` | {label} | {summary[key]:.3f} | {met} | {'.'.join(num)} [{raw(*num)}] | "
                     f"{'.'.join(den)} [{raw(*den)}] |")
    for key, (label, variant, target) in RSS_KEYS.items():
        if key not in summary:
            continue
        met = "reported" if target is None else f"<= {target:g} {'met' if summary[key] <= target else 'MISSED'}"
        lines.append(f"| `{key}` | peak RSS above the live state during a {label} / the state's bytes | "
                     f"{summary[key]:.3f} | {met} | {samples[f'{variant}.extra_bytes'][0] / 2**20:.0f} MiB | "
                     f"{summary['state_bytes'] / 2**20:.0f} MiB |")
    if "fingerprint_secs_per_gib" in summary:
        lines += ["", f"Fingerprint pass {summary['fingerprint_secs_per_gib']:.3f} s/GiB; one read of the state "
                  f"{summary['state_read_secs_per_gib']:.3f} s/GiB (`fingerprint_secs_per_gib`, "
                  "`state_read_secs_per_gib`)."]
    if summary["blocking_parts_secs"]:  # the saves variant ran
        lines += ["", "Where async save() blocks (medians, seconds): " + ", ".join(
                      f"{part} {secs:.4f}" for part, secs in summary["blocking_parts_secs"].items())
                  + f"; in all {summary['medians_secs']['async_save.blocking']:.4f} "
                  f"(plain Orbax {summary['medians_secs']['orbax_save.blocking']:.4f})."]
    return "\n".join(lines)


def main(argv):
    del argv
    if _WORKDIR.value and not os.path.isdir(_WORKDIR.value):
        raise ValueError(f"--workdir={_WORKDIR.value}: not a directory")
    if _JSON_OUT.value and not os.path.isdir(os.path.dirname(os.path.abspath(_JSON_OUT.value))):
        raise ValueError(f"--json_out={_JSON_OUT.value}: its directory does not exist")
    root = tempfile.mkdtemp(prefix="checkpoint_bench_", dir=_WORKDIR.value or tempfile.gettempdir())
    meter = common.LoadMeter()
    try:
        logging.info("state: %g GiB float32 + step; workdir %s", _STATE_GIB.value, root)
        samples = measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = {"other_cores": meter.other_cores(), "load_average_at_start": meter.load_average_at_start,
            "load_average_at_end": os.getloadavg()}
    summary = summarize(samples)
    print(report(summary, samples, load))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump({"command": " ".join(sys.argv), "repeats": _REPEATS.value,
                       "samples_per_process": _SAMPLES.value, "load": load, **summary, "samples": samples},
                      f, indent=1, sort_keys=True)


if __name__ == "__main__":
    entry.run(main)
