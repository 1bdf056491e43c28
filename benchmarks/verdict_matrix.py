"""Verdict matrix: issue 49's acceptance, measured. Genuine runs must never fail on another layout, broken
ones must fail the step named and pass the steps before it, and a silent corruption must be caught wherever
it moves the record beyond the margin times the noise (verifier/evidence.py's rule).

  genuine   --design=covering (issue 56, the default): the families of benchmarks/verdict_runs.py (the mlp, the
            wide mlp, the transformer in float32 and bfloat16 compute, a Dense-with-bias -> BatchNorm ->
            LayerNorm -> dropout classifier, the cnn example, examples/own_loop.py) in benchmarks/verdict_design.py's
            covering design: every interval (--intervals), recording layout (--recordings) and verifier device
            count (--verifier_devices) with every family, a run of two intervals (the first proved from the init,
            the second from a saved step, the cheap proof at every save with a probe).
            --design=families (issue 49's): every family, the records transformer from a 2-process pod resumed on
            4 too, --seeds seeds each, recorded on data=4,model=2 and proved on each other layout of the family
  broken    every case of benchmarks/verdict_broken.py, proved on each of --broken_meshes
  silent    one kernel element times (1 + size) at step 15 of 30 (saves every 10), per size and mesh
  late      the forgery at step 30 after 10..30 were proved: what 30's verdict and 40..60 become

Per run it records the verdicts (pass, fail, inconclusive), the exit code `verify --once` would give (0 only
when every committed step is proved, 3 when one is not, 1 when one failed) and
the evidence ratios: distance to the replay / the noise measured between the verifier's layouts. Prints
one table per part and summary lines, and writes every verdict to --json_out. Runs and proofs happen in
this process (8 fake CPU devices; a mesh of 2 uses two of them), the records pods in subprocesses; its
scratch lives under $TMPDIR and is deleted at the end.

  PYTHONPATH=. .venv/bin/python -m benchmarks.verdict_matrix [--groups=genuine] [--json_out=matrix.json]
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

from benchmarks import verdict_broken, verdict_design, verdict_runs  # noqa: E402
from runtime import entry  # noqa: E402
from verifier.evidence import MARGIN  # noqa: E402

_GROUPS = flags.DEFINE_list("groups", ["genuine", "broken", "silent", "late"], "Parts of the matrix to run.")
_DESIGN = flags.DEFINE_enum("design", "covering", ["covering", "families"],
                            "The genuine part: the covering design of intervals, recording layouts and verifier device "
                            "counts (benchmarks/verdict_design.py), or every family on its own layouts (--seeds).")
_FAMILIES = flags.DEFINE_list("families", None, "Genuine families to train (default: the design's).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "--design=families: seeds per family (its first ones).", lower_bound=1,
                              upper_bound=3)
_INTERVALS = flags.DEFINE_list("intervals", [str(i) for i in verdict_design.INTERVALS],
                               "--design=covering: steps between saves (a run is two intervals).")
_RECORDINGS = flags.DEFINE_string("recordings", ";".join(verdict_design.RECORDINGS),
                                  "--design=covering: ';'-separated meshes the runs are recorded on.")
_VERIFIER_DEVICES = flags.DEFINE_list("verifier_devices", [str(n) for n in verdict_design.DEVICE_COUNTS],
                                      "--design=covering: the verifiers' device counts (of the 8 fake devices).")
_CELLS = flags.DEFINE_string("cells", ":", "--design=covering: the slice START:END of the design's cells to run "
                              "(shortest intervals first; ':' all of them), to split the design over processes.")
COVERING_FAMILIES = ("mlp", "wide_mlp", "transformer", "transformer_bf16", "bn_classifier", "cnn", "own_loop")
_CASES = flags.DEFINE_list("cases", list(verdict_broken.CASES) + list(verdict_broken.CONTROLS),
                           "Broken cases (and controls) to run.")
_BROKEN_MESHES = flags.DEFINE_string("broken_meshes", "data=4,model=2;data=2",
                                     "';'-separated verifier meshes of the broken cases (data=4,model=2 records).")
_SILENT_SIZES = flags.DEFINE_list("silent_sizes", ["0", "1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2"],
                                  "Relative sizes of the silent corruption (0: the loop with nothing changed).")
_SILENT_KINDS = flags.DEFINE_list("silent_kinds", ["kernel", "input"],
                                  "What the silent corruption changes: a kernel element of the state after step 15, "
                                  "or one input element of step 15 (and every 29th step after it).")
_SILENT_MODELS = flags.DEFINE_list("silent_models", ["mlp"], "Models the silent corruption is run on: mlp, wide_mlp, "
                                   "transformer (kernel only: its input is tokens), bn_classifier.")
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


def families() -> list[str]:
    return _FAMILIES.value or list(COVERING_FAMILIES if _DESIGN.value == "covering" else verdict_runs.FAMILIES)


def design() -> list[verdict_design.Cell]:
    recordings = tuple(meshes(_RECORDINGS))
    cells = verdict_design.covering({name: verdict_runs.FAMILIES[name].seeds for name in families()},
                                    tuple(int(i) for i in _INTERVALS.value), recordings,
                                    tuple(int(n) for n in _VERIFIER_DEVICES.value))
    start, _, end = _CELLS.value.partition(":")
    return cells[int(start) if start else None:int(end) if end else None]


def genuine(scratch: str) -> tuple[list[dict], list[str]]:
    return covering(scratch) if _DESIGN.value == "covering" else genuine_families(scratch)


def covering(scratch: str) -> tuple[list[dict], list[str]]:
    """Every cell of the design: trained once on its recording layout, proved on each of its verifier meshes."""
    cells = design()
    logging.info("covering design: %d trainings (%d steps), %d proofs; gaps: %s", len(cells),
                 verdict_design.trained_steps(cells), verdict_design.proofs(cells),
                 verdict_design.gaps(cells) or "none")
    runs, found = [], {}
    for cell in cells:
        workdir = os.path.join(scratch, f"{cell.family}-{cell.seed}-{cell.interval}")
        began = time.perf_counter()
        verdict_runs.train(verdict_runs.FAMILIES[cell.family], cell.seed, workdir, scratch, cell.interval,
                           cell.recording)
        logging.info("trained %s seed %d, interval %d on %s in %.0fs", cell.family, cell.seed, cell.interval,
                     cell.recording, time.perf_counter() - began)
        for mesh in cell.verifier_meshes:
            began = time.perf_counter()
            verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
            found.setdefault(cell.family, []).append((cell.seed, verification))
            runs.append({"family": cell.family, "seed": cell.seed, "interval": cell.interval,
                         "recording": cell.recording, "devices": verdict_design.device_count(mesh),
                         "secs": time.perf_counter() - began, **as_dict(verification)})
            logging.info("proved %s seed %d interval %d (%s) on %s: exit %d, %s", cell.family, cell.seed,
                         cell.interval, cell.recording, mesh, verification.exit_code,
                         {s: (r.level, r.status, r.ratio, r.cheap_ratio) for s, r in verification.steps.items()})
            write_partial("genuine", runs)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [genuine_row(name, found[name]) for name in families() if name in found]
    rows.append("")
    rows.append("| family | seed | interval | recorded on | verifier mesh | verdicts (step: level status ratio/cheap) "
                "| exit |")
    rows.append("|---|---|---|---|---|---|---|")
    rows += [run_row(run) for run in runs]
    return runs, rows


def run_row(run: dict) -> str:
    cells = ", ".join(f"{s}: {r['level']} {r['status']} {ratio_text(r['ratio'], r['status'])}/"
                      f"{ratio_text(r['cheap_ratio'])}" for s, r in run["steps"].items())
    return (f"| {run['family']} | {run['seed']} | {run['interval']} | `{run['recording']}` | `{run['mesh']}` | "
            f"{cells} | {run['exit_code']} |")


def write_partial(group: str, runs: list[dict]) -> None:
    """What a long part has found so far, beside --json_out (a run cut short keeps it)."""
    if _JSON_OUT.value:
        with open(_JSON_OUT.value + f".{group}.partial", "w") as f:
            json.dump(runs, f, indent=1)


def genuine_families(scratch: str) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    for name in families():
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
    exits = "/".join(str(sum(v.exit_code == code for _, v in found)) for code in (0, 3, 1))
    return (f"| {name} | {len(found)} | {counts} | {exits} | {ratio_text(max(from_init, default=None))} | "
            f"{ratio_text(max(from_saved, default=None))} | {ratio_text(max(cheap, default=None))} | {where} |")


def broken(scratch: str, bases: verdict_broken.Bases) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    cases = {**verdict_broken.CASES, **verdict_broken.CONTROLS}
    for name in _CASES.value:
        case = cases[name]
        workdir = os.path.join(scratch, name)
        case.make(bases, workdir)
        for mesh in case.meshes or meshes(_BROKEN_MESHES):
            verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
            named = verification.steps.get(case.named)
            before_pass = all(verification.steps[s].status == "pass" for s in case.before)
            after = [s.status for s in verification.steps.values() if s.step > case.named]
            control = name in verdict_broken.CONTROLS
            detected = verification.exit_code == 0 if control else (
                named is not None and named.status == "fail" and before_pass)
            runs.append({"case": name, "named": case.named, "control": control, "detected": detected,
                         **as_dict(verification)})
            logging.info("broken %s on %s: exit %d, %s", name, mesh, verification.exit_code,
                         {s: (r.level, r.status, r.ratio, r.cheap_ratio) for s, r in verification.steps.items()})
            write_partial("broken", runs)
            ratio = None if named is None else (named.ratio if named.status != "pass" or named.cheap_ratio is None
                                                else max(named.ratios))
            rows.append(f"| {name} | {mesh} | {named.level + ' ' + named.status if named else 'none'} | "
                        f"{ratio_text(ratio, named.status if named else 'pass')} | "
                        f"{'pass' if before_pass else 'BLAMED'} | {after.count('pass')}/{after.count('fail')} | "
                        f"{'yes' if detected else 'NO'} |")
        shutil.rmtree(workdir, ignore_errors=True)
    return runs, rows


SILENT_MODELS = {"mlp": {}, "wide_mlp": {"input_dim": 1024, "hidden_dim": 2048, "num_layers": 2, "seed": 4},
                 "transformer": {"model": "transformer"}, "bn_classifier": {"model": "examples.bn_classifier:spec"}}


def silent(scratch: str, bases: verdict_broken.Bases) -> tuple[list[dict], list[str]]:
    runs, rows = [], []
    for model in _SILENT_MODELS.value:
        for kind in _SILENT_KINDS.value:
            if kind == "input" and model == "transformer":
                continue  # its input is tokens: an integer has no small relative change
            for size in _SILENT_SIZES.value:
                workdir = os.path.join(scratch, f"silent-{model}-{kind}-{size}")
                verdict_broken.silently_corrupted(bases, workdir, float(size), kind, SILENT_MODELS[model])
                cells = []
                for mesh in meshes(_SILENT_MESHES):
                    verification = verdict_runs.verify_copy(workdir, mesh, workdir + "-verified")
                    named = verification.steps[20]
                    runs.append({"model": model, "kind": kind, "size": float(size), "caught": named.status == "fail",
                                 **as_dict(verification)})
                    cells.append(f"{ratio_text(named.ratio, named.status)} ({named.status})")
                    write_partial("silent", runs)
                rows.append(f"| {model} | {kind} | {size} | {' | '.join(cells)} |")
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
             f"  genuine runs with a fail (exit 1)  {sum(run['exit_code'] == 1 for run in result.get('genuine', []))}",
             f"  genuine runs exit 0/3/1  "
             f"{'/'.join(str(sum(run['exit_code'] == c for run in result.get('genuine', []))) for c in (0, 3, 1))}",
             f"  genuine verdicts fail  {sum(s['status'] == 'fail' for s in genuine_steps)}",
             f"  genuine verdicts inconclusive  {sum(s['status'] == 'inconclusive' for s in genuine_steps)}",
             *(f"    inconclusive because  {reason} ({count})"
               for reason, count in inconclusive_reasons(genuine_steps)),
             f"  largest genuine ratio  {largest:.3g}",
             f"  largest genuine ratio, full proof  {max(full, default=math.nan):.3g}",
             f"  largest genuine ratio, cheap proof  {max(cheap, default=math.nan):.3g}",
             f"  broken runs whose named step failed  {len(failed)}/{len(cases)}",
             f"  broken runs detected  {sum(run['detected'] for run in cases)}/{len(cases)}",
             f"  smallest broken ratio  {smallest:.3g}",
             f"  smallest broken / largest genuine  {smallest / largest if largest else math.nan:.3g}"]
    silent_runs = result.get("silent", [])
    for model, kind in dict.fromkeys((run["model"], run["kind"]) for run in silent_runs):
        for mesh in meshes(_SILENT_MESHES):
            caught = [run["size"] for run in silent_runs if run["caught"] and run["size"]
                      and (run["model"], run["kind"], run["mesh"]) == (model, kind, mesh)]
            lines.append(f"  silent corruption ({model}, {kind}): smallest size caught on {mesh}  "
                         f"{min(caught, default=math.nan):.3g}")
    return lines


def inconclusive_reasons(steps: list[dict]) -> list[tuple[str, int]]:
    """Each reason an inconclusive verdict gives (its detail after what was replayed), with its count."""
    reasons: dict[str, int] = {}
    for step in steps:
        if step["status"] == "inconclusive":
            reason = step["detail"].split(": ", 1)[-1][:160]
            reasons[reason] = reasons.get(reason, 0) + 1
    return sorted(reasons.items(), key=lambda item: -item[1])


def header(group: str) -> str:
    cells = {"genuine": ["family", "runs", "verdicts pass/fail/inconclusive", "runs exit 0/3/1",
                         "largest ratio from the init", "largest ratio from a saved step", "largest cheap-proof ratio",
                         "largest at"],
             "broken": ["case", "verifier mesh", "named step's verdict", "its ratio", "steps before it",
                        "steps after it pass/fail", "detected"],
             "silent": ["model", "what", "size", *(f"step 20 on {mesh}" for mesh in meshes(_SILENT_MESHES))],
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
