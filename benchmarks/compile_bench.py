"""Compile benchmark: a restart's compile of the save marks against the step's, from a warm cache.

  PYTHONPATH=. .venv/bin/python -m benchmarks.compile_bench [--models=mlp,transformer] [--samples=3] [--json_out=FILE]

A relaunch compiles two executables before its first step: the step and the marks' fingerprints
(checkpointing/_src/marks.py; the restore's check needs them); the marks' summaries compile at the first
probe. With the persistent compilation cache warm, each still costs a trace, a lowering and a load of
the cached executable, in every process at every restart. Per model (the goodput benchmark's sizes:
--num_layers=4, --hidden_dim=1024), a fresh process builds the trainer's program (trainer/program.py) on
a data=2 mesh of 2 fake CPU devices and fills a fresh cache (the "cold" totals); then --samples more
fresh processes each do what a relaunch does and time each phase (`.trace`, `.lower()`, `.compile()`)
of, in this order: the step (`StepFn.jitted`); `fingerprints` and `summaries`, marks_fn's two
executables (Checkpointer.prepare compiles the first); and, as the baseline, `one_executable`: both in one jit
of `step_marks` under `lax.cond` per part, what the trainer compiled before its restore until this
benchmark; and `kept_fingerprints`: the fingerprints as the trainer now gets them (Checkpointer.prepare,
checkpointing/_src/executables.py: the executable the cold process kept, loaded; its load counts as the
compile). And `computation`: the code identity (trainer/program.py `computation`: the jaxprs of the init,
the step and the batch on unsharded inputs, printed and hashed; all of it counted as its trace), timed as
a fresh trace, and `shapes_only`: the same three traced by jax.eval_shape, what the start-up's model check
traced before the identity was taken from its trace (their difference is what the start-up pays now;
`computation(config)` itself then finds validate's trace kept). Reported: the medians of each phase, and
over the step's total: the restart's marks (fingerprints), kept, all the marks (fingerprints + summaries),
the one executable, the computation (over the warm step's total, and over the cold one's: a first start
compiles the step cold) and what it adds to the start-up (computation - shapes_only). Nothing is a test
threshold; only the ratios are comparable between machines.
"""

import json
import statistics
import tempfile
import time

from absl import app, flags, logging

from benchmarks import common

CHILD = flags.DEFINE_boolean("child", False, "Internal: measure one process (trainer flags name the model).")
CACHE_DIR = flags.DEFINE_string("cache_dir", None, "Internal: the child's compilation cache.")
MODELS = flags.DEFINE_list("models", ["mlp", "transformer"], "Trainer models to measure.")
SAMPLES = flags.DEFINE_integer("samples", 3, "Warm processes per model (after the one that fills the cache).",
                               lower_bound=1)
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the numbers as JSON here.")

SIZES = {"mlp": ["--hidden_dim=1024", "--input_dim=1024"], "transformer": ["--hidden_dim=1024"]}
PHASES = ("trace", "lower", "compile")
PARTS = ("step", "fingerprints", "summaries", "one_executable", "kept_fingerprints", "computation", "shapes_only")


def _timed(traceable, *args) -> dict[str, float]:
    """Seconds of each phase of jit's ahead-of-time path for `traceable` (a jitted function)."""
    begin = time.perf_counter()
    traced = traceable.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    return {"trace": traced_at - begin, "lower": lowered_at - traced_at, "compile": time.perf_counter() - lowered_at}


def measure_child() -> dict:
    """In the child: builds the program of the trainer flags and times the step's and the marks' compile."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from checkpointing._src import executables
    from checkpointing._src import marks as marks_lib
    from trainer import compile_cache
    from trainer import flags as trainer_flags
    from trainer import models, program as program_lib
    from trainer.program import build_mesh, build_program, validate

    compile_cache.use(CACHE_DIR.value)
    config = validate(trainer_flags.config_from_flags(), jax.device_count(), check_workdir=False)
    mesh = build_mesh(config)
    spec = models.resolve(config.model)
    begin = time.perf_counter()
    program_lib._trace(config, spec)  # before the program is built and compiled, as in the start-up
    traced = {"trace": time.perf_counter() - begin, "lower": 0.0, "compile": 0.0}
    begin = time.perf_counter()
    _shapes_only(config, spec)
    shapes = {"trace": time.perf_counter() - begin, "lower": 0.0, "compile": 0.0}
    program = build_program(config, mesh)
    abstract = program.abstract_state
    step = _timed(program.step_fn.jitted, abstract, program.abstract_batch)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    marks = marks_lib.marks_fn(shardings)
    fingerprints = _timed(marks.fingerprints, abstract)
    summaries = _timed(marks.summaries, abstract)
    replicated = NamedSharding(mesh, P())
    one = jax.jit(lambda state, flags: marks_lib.step_marks(state, flags, shardings),
                  in_shardings=(shardings, replicated), out_shardings=(replicated, replicated))
    one_executable = _timed(one, abstract, marks_lib.request(mesh).flags)
    begin = time.perf_counter()
    _, source = executables.load_or_compile("marks-fingerprints", marks.fingerprints_jit, (abstract,),
                                            marks_lib._FINGERPRINT_SOURCES)
    kept = {"trace": 0.0, "lower": 0.0, "compile": time.perf_counter() - begin}
    leaves = jax.tree.leaves(abstract)
    layouts = {(x.shape, str(x.dtype), str(x.sharding.spec)) for x in leaves}
    return {"step": step, "fingerprints": fingerprints, "summaries": summaries, "one_executable": one_executable,
            "kept_fingerprints": kept, "kept_source": source, "computation": traced, "shapes_only": shapes,
            "leaves": len(leaves),
            "layouts": len(layouts)}


def _shapes_only(config, spec) -> None:
    """The init, the batch and the step traced by eval_shape alone (no jaxpr kept, printed or hashed)."""
    import functools

    import jax

    from trainer import data, program as program_lib

    module, codec, init = program_lib._module_and_init(config, spec)
    abstract = jax.eval_shape(init)
    batch = jax.eval_shape(functools.partial(data.synthetic_batch, spec, config), jax.ShapeDtypeStruct((), "int32"))
    jax.eval_shape(program_lib.make_step(config, spec, module, codec), abstract, batch)


def _child_args(model: str, cache_dir: str, workdir: str) -> list[str]:
    return ["--child", f"--cache_dir={cache_dir}", f"--workdir={workdir}", f"--model={model}", "--mesh=data=2",
            "--num_layers=4", "--batch_size=64", *SIZES[model]]


def measure_model(model: str, samples: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as root:
        args = _child_args(model, f"{root}/cache", f"{root}/workdir")
        cold = common.run_child("benchmarks.compile_bench", args, devices=2)
        warm = [common.run_child("benchmarks.compile_bench", args, devices=2) for _ in range(samples)]
    if cold["kept_source"] != "compiled" or any(w["kept_source"] != "disk" for w in warm):
        raise RuntimeError(f"kept fingerprints: cold {cold['kept_source']}, warm {[w['kept_source'] for w in warm]}")
    medians = {what: {phase: statistics.median(w[what][phase] for w in warm) for phase in PHASES} for what in PARTS}
    totals = {what: statistics.median(sum(w[what].values()) for w in warm) for what in PARTS}
    both = statistics.median(sum(w["fingerprints"].values()) + sum(w["summaries"].values()) for w in warm)
    return {"leaves": cold["leaves"], "layouts": cold["layouts"], "warm": medians, "warm_total": totals,
            "cold_total": {what: sum(cold[what].values()) for what in PARTS},
            "restart_marks_over_step": totals["fingerprints"] / totals["step"],
            "kept_marks_over_step": totals["kept_fingerprints"] / totals["step"],
            "all_marks_over_step": both / totals["step"],
            "one_executable_over_step": totals["one_executable"] / totals["step"],
            "computation_over_step": totals["computation"] / totals["step"],
            "computation_over_cold_step": totals["computation"] / sum(cold["step"].values()),
            "added_over_step": (totals["computation"] - totals["shapes_only"]) / totals["step"], "samples": warm}


def report(results: dict) -> str:
    header = ["model", "leaves (layouts)", *[f"{what}: trace / lower / load = total s" for what in PARTS],
              "restart's marks / step", "kept / step", "all marks / step", "one executable / step",
              "computation / step", "computation / cold step", "added / step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, r in results.items():
        cells = [" / ".join(f"{r['warm'][what][p]:.3f}" for p in PHASES) + f" = {r['warm_total'][what]:.3f}"
                 for what in PARTS]
        lines.append(f"| {model} | {r['leaves']} ({r['layouts']}) | " + " | ".join(cells) +
                     f" | {r['restart_marks_over_step']:.2f} | {r['kept_marks_over_step']:.2f} | "
                     f"{r['all_marks_over_step']:.2f} | {r['one_executable_over_step']:.2f} | "
                     f"{r['computation_over_step']:.2f} | {r['computation_over_cold_step']:.2f} | "
                     f"{r['added_over_step']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    if CHILD.value:
        print(json.dumps(measure_child()))  # the child's one result line (run_child reads the last line)
        return
    load = common.LoadMeter()
    results = {model: measure_model(model, SAMPLES.value) for model in MODELS.value}
    logging.info("other processes' load during the run: %.2f cores (load average at the start %.2f)",
                 load.other_cores(), load.load_average_at_start[0])
    print(report(results))
    if JSON_OUT.value:
        with open(JSON_OUT.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    from trainer import flags as _trainer_flags  # noqa: F401  (the child parses the trainer's flags)

    app.run(main)
