"""Verdict matrix: issue 49's acceptance, measured. Genuine runs must never fail on another layout, broken
ones must fail the step named and pass the steps before it, and a silent corruption must be caught wherever
it moves the record beyond the margin times the noise (verifier/evidence.py's rule).

  genuine   every family of benchmarks/verdict_runs.py (the mlp, the transformer in float32 and bfloat16
            compute, the wide mlp, a Dense-with-bias -> BatchNorm -> LayerNorm -> dropout classifier, the cnn
            example, examples/own_loop.py, the records transformer from a 2-process pod resumed on 4), --seeds
            seeds each, recorded on data=4,model=2 and proved on each other layout of the family: the first
            interval from the init, the later ones from saved steps, the cheap proof at every save with a probe
  broken    every case of benchmarks/verdict_broken.py, proved on each of --broken_meshes
  silent    one kernel element times (1 + size) at step 15 of 30 (saves every 10), per size and mesh
  late      the forgery at step 30 after 10..30 were proved: what 30's verdict and 40..60 become

Per run it records the verdicts (pass, fail, inconclusive), the exit code `verify --once` would give and
the evidence ratios: distance to the replay / the noise measured between the verifier's layouts. Prints
one table per part and summary lines, and writes every verdict to --json_out. Runs and proofs happen in
this process (8 fake CPU devices; a mesh of 2 uses two of them), the records pods in subprocesses; its
scratch lives under $TMPDIR and is deleted at the end.

  PYTHONPATH=. .venv/bin/python -m benchmarks.verdict_matrix [--seeds=3] [--json_out=matrix.json]
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import flags, logging  # noqa: E402

from benchmarks import verdict_broken, verdict_runs  # noqa: E402
from runtime import entry  # noqa: E402
from verifier.evidence import MARGIN  # noqa: E402

_GROUPS = flags.DEFINE_list("groups", ["genuine", "broken", "silent", "late"], "Parts of the matrix to run.")
_FAMILIES = flags.DEFINE_list("families", list(verdict_runs.FAMILIES), "Genuine families to train.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per genuine family (its first ones).", lower_bound=1, upper_bound=3)
_CASES = flags.DEFINE_list("cases", list(verdict_broken.CASES) + list(verdict_broken.CONTROLS),
                           "Broken cases (and controls) to run.")
_BROKEN_MESHES = flags.DEFINE_string("broken_meshes", "data=4,model=2;data=2",
                                     "';'-separated verifier meshes of the broken cases (data=4,model=2 records).")
_SILENT_SIZES = flags.DEFINE_list("silent_sizes", ["0", "1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2"],
                                  "Relative sizes of the silent corruption (0: the loop with nothing changed).")
_SILENT_MESHES = flags.DEFINE_string("silent_meshes", "data=4,model=2;data=2;data=2,model=4",
                                     "';'-separated verifier meshes of the silent corruption.")
_JSON_OUT = flags.DEFINE_string("json_out", "", "Where every run's verdicts are written (JSON); empty: nowhere.")


def meshes(flag) -> list[str]:
    return [mesh.strip() for mesh in flag.value.split(";") if mesh.strip()]


def as_dict(verification: verdict_runs.Verification) -> dict:
    return {"mesh": verification.mesh, "exit_code": verification.exit_code,
            "steps": {str(s): dataclasses.asdict(r) for s, r in verification.steps.items()}}


def ratio_text(value: float | None, status: str = "pass") -> str:
    if value is None:
        return "inf" if status == "fail" else "-"
    return f"{value:.3g}"


def genuine(scratch: str) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    for name in _FAMILIES.value:
        family = verdict_runs.FAMILIES[name]
        found = []
        for seed in family.seeds[:_SEEDS.value]:
            workdir = os.path.join(scratch, f"{name}-{seed}")
            began = time.perf_counter()
            verdict_runs.train(family, seed, workdir, scratch)
            logging.info("trained %s seed %d in %.0fs", name, seed, time.perf_counter() - began)
            for mesh in family.meshes:
                verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
                found.append((seed, verification))
                runs.append({"family": name, "seed": seed, **as_dict(verification)})
            shutil.rmtree(workdir, ignore_errors=True)
        rows.append(genuine_row(name, found))
    return runs, rows


def genuine_row(name: str, found: list) -> str:
    steps = [(seed, v.mesh, s) for seed, v in found for s in v.steps.values()]
    counts = "/".join(str(sum(s.status == status for _, _, s in steps)) for status in ("pass", "fail", "inconclusive"))
    full = [s for _, _, s in steps if s.level == "reproduced" and s.ratio is not None]  # the full proof's
    from_init = [s.ratio for s in full if s.replayed_from == 0]
    from_saved = [s.ratio for s in full if s.replayed_from]
    cheap = [s.cheap_ratio for _, _, s in steps if s.cheap_ratio is not None]
    worst = max(steps, key=lambda item: max(item[2].ratios, default=0.0), default=None)
    where = f"seed {worst[0]}, {worst[1]}, step {worst[2].step}" if worst else "-"
    exits = sum(v.exit_code == 0 for _, v in found)
    return (f"| {name} | {len(found)} | {counts} | {exits} | {ratio_text(max(from_init, default=None))} | "
            f"{ratio_text(max(from_saved, default=None))} | {ratio_text(max(cheap, default=None))} | {where} |")


def broken(scratch: str, bases: verdict_broken.Bases) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    cases = {**verdict_broken.CASES, **verdict_broken.CONTROLS}
    for name in _CASES.value:
        case = cases[name]
        workdir = os.path.join(scratch, name)
        case.make(bases, workdir)
        for mesh in meshes(_BROKEN_MESHES):
            verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
            named = verification.steps.get(case.named)
            before_pass = all(verification.steps[s].status == "pass" for s in case.before)
            after = [s.status for s in verification.steps.values() if s.step > case.named]
            control = name in verdict_broken.CONTROLS
            detected = verification.exit_code == 0 if control else (
                named is not None and named.status == "fail" and before_pass)
            runs.append({"case": name, "named": case.named, "control": control, "detected": detected,
                         **as_dict(verification)})
            ratio = None if named is None else (named.ratio if named.status != "pass" or named.cheap_ratio is None
                                                else max(named.ratios))
            rows.append(f"| {name} | {mesh} | {named.level + ' ' + named.status if named else 'none'} | "
                        f"{ratio_text(ratio, named.status if named else 'pass')} | "
                        f"{'pass' if before_pass else 'BLAMED'} | {after.count('pass')}/{after.count('fail')} | "
                        f"{'yes' if detected else 'NO'} |")
        shutil.rmtree(workdir, ignore_errors=True)
    return runs, rows


def silent(scratch: str, bases: verdict_broken.Bases) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    for size in _SILENT_SIZES.value:
        workdir = os.path.join(scratch, f"silent-{size}")
        verdict_broken.silently_corrupted(bases, workdir, float(size))
        cells = []
        for mesh in meshes(_SILENT_MESHES):
            verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
            named = verification.steps[20]
            runs.append({"size": float(size), "caught": named.status == "fail", **as_dict(verification)})
            cells.append(f"{ratio_text(named.ratio, named.status)} ({named.status})")
        rows.append(f"| {size} | {' | '.join(cells)} |")
        shutil.rmtree(workdir, ignore_errors=True)
    return runs, rows


def late_forgery(scratch: str, bases: verdict_broken.Bases) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    for mesh in meshes(_BROKEN_MESHES):
        workdir = os.path.join(scratch, f"late-{mesh}")
        found = verdict_broken.forged_after_proof(bases, workdir, mesh)
        runs.append({"mesh": mesh, **{k: {str(s): dataclasses.asdict(r) for s, r in v.items()}
                                      for k, v in found.items()}})
        after = " ".join(f"{s}:{r.level} {r.status}" for s, r in found["after"].items())
        rows.append(f"| {mesh} | {found['before'][30].status} | {after} |")
        shutil.rmtree(workdir, ignore_errors=True)
    return runs, rows


def summary(result: dict) -> list[str]:
    genuine_steps = [s for run in result.get("genuine", []) for s in run["steps"].values()]
    full = [s["ratio"] for s in genuine_steps if s["level"] == "reproduced" and s["ratio"] is not None]
    cheap = [s["cheap_ratio"] for s in genuine_steps if s["cheap_ratio"] is not None]
    cases = [run for run in result.get("broken", []) if not run["control"]]
    named = [run["steps"].get(str(run["named"])) for run in cases]
    failed = [s for s in named if s and s["status"] == "fail"]
    broken_ratios = [math.inf if s["ratio"] is None else s["ratio"] for s in failed]
    largest, smallest = max(full + cheap, default=math.nan), min(broken_ratios, default=math.nan)
    lines = [f"  margin (verifier/evidence.py)  {MARGIN:g}",
             f"  genuine runs  {len(result.get('genuine', []))}",
             f"  genuine runs with a fail  {sum(run['exit_code'] != 0 for run in result.get('genuine', []))}",
             f"  genuine verdicts inconclusive  {sum(s['status'] == 'inconclusive' for s in genuine_steps)}",
             f"  largest genuine ratio  {largest:.3g}",
             f"  largest genuine ratio, full proof  {max(full, default=math.nan):.3g}",
             f"  largest genuine ratio, cheap proof  {max(cheap, default=math.nan):.3g}",
             f"  broken runs whose named step failed  {len(failed)}/{len(cases)}",
             f"  broken runs detected  {sum(run['detected'] for run in cases)}/{len(cases)}",
             f"  smallest broken ratio  {smallest:.3g}",
             f"  smallest broken / largest genuine  {smallest / largest if largest else math.nan:.3g}"]
    for mesh in meshes(_SILENT_MESHES):
        caught = [run["size"] for run in result.get("silent", []) if run["mesh"] == mesh and run["caught"]]
        lines.append(f"  silent corruption: smallest size caught on {mesh}  {min(caught, default=math.nan):.3g}")
    return lines


def header(group: str) -> str:
    cells = {"genuine": ["family", "runs", "verdicts pass/fail/inconclusive", "runs exit 0",
                         "largest ratio from the init", "largest ratio from a saved step", "largest cheap-proof ratio",
                         "largest at"],
             "broken": ["case", "verifier mesh", "named step's verdict", "its ratio", "steps before it",
                        "steps after it pass/fail", "detected"],
             "silent": ["size", *(f"step 20 on {mesh}" for mesh in meshes(_SILENT_MESHES))],
             "late": ["verifier mesh", "step 30's verdict before the forgery", "every verdict after it"]}[group]
    return f"| {' | '.join(cells)} |\n|{'---|' * len(cells)}"


GROUPS = {"genuine": genuine, "broken": broken, "silent": silent, "late": late_forgery}


def main(argv) -> None:
    del argv
    scratch = tempfile.mkdtemp(prefix="verdict_matrix-")  # under $TMPDIR, as every benchmark's scratch
    result, began = {}, time.perf_counter()
    try:
        bases = verdict_broken.Bases(scratch)
        for group in _GROUPS.value:
            run = GROUPS[group]
            result[group], rows = run(scratch) if group == "genuine" else run(scratch, bases)
            print(f"\n{group}\n{header(group)}\n" + "\n".join(rows), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print("\n".join(summary(result)))
    print(f"  wall seconds  {time.perf_counter() - began:.0f}")
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    entry.run(main)
