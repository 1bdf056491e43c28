"""Input benchmark: real records (Grain read-ahead) against synthetic batches of the same shape.

The parent prepares a real corpus (the stdlib's sources, bytes tokenizer: trainer/prepare.py's
prepare()) in a temporary folder and runs the measurement in a child with 8 fake CPU devices
(benchmarks/common.run_child), mesh data=8, the built-in transformer:

  batch     the time to produce one global batch, back to back (nothing else runs): records
            (RecordBatches.__call__ with its read-ahead, until the array is ready) and synthetic
            (the program's jitted batch function, until ready)
  steps     the wall time per train step (dispatch, then wait for the step) over --steps steps,
            with each batch function, in rounds that alternate them; for records the time each
            step waited for rows not read yet (RecordBatches.last_wait_secs) and the time its
            batch call took in all (the wait plus placing the rows on the devices)

Ratios of medians are the result (target: step time on records / on synthetic <= 1.05); the
header says how busy the rest of the machine was.

  PYTHONPATH=. .venv/bin/python -m benchmarks.input_bench [--steps=30] [--rounds=2] [--max_bytes=4000000]
"""

import json
import shutil
import statistics
import tempfile
import time

from absl import flags

from benchmarks import common
from runtime import entry

_STEPS = flags.DEFINE_integer("steps", 30, "Measured steps per round and batch function.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds, each timing records then synthetic.", lower_bound=1)
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 4_000_000, "Corpus bytes read from the stdlib.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Global batch.", lower_bound=8)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per example.", lower_bound=1)
_HIDDEN = flags.DEFINE_integer("hidden_dim", 128, "Transformer width.", lower_bound=8)
_CHILD = flags.DEFINE_string("child_records", None, "Internal: run the measurement on this glob.")

WARMUP_STEPS = 3


def measure(pattern: str) -> dict:
    import jax
    from trainer import input as data_input
    from trainer import model_config
    from trainer.program import build_program, build_mesh, validate

    config = validate(model_config.from_flat({
        "workdir": tempfile.gettempdir(), "model": "transformer", "mesh": (("data", 8),), "batch_size": _BATCH.value,
        "seq_len": _SEQ_LEN.value, "vocab_size": 257, "hidden_dim": _HIDDEN.value, "num_heads": 4}),
        jax.device_count(), check_workdir=False)
    program = build_program(config, build_mesh(config))  # --data=synthetic, the default
    # The trainer's own choice of batch function for --data=records:<glob> (trainer/program.py).
    records = build_program(model_config.replace(config, data=f"records:{pattern}"), program.mesh).batch_fn
    assert isinstance(records, data_input.RecordBatches)
    dataset = records.dataset
    synthetic = lambda step: program.batch_fn(jax.numpy.asarray(step, jax.numpy.int32))  # noqa: E731
    assert records(0)["tokens"].shape == synthetic(0)["tokens"].shape
    out = {"records": dataset.num_records, "batch": {"records": [], "synthetic": []},
           "step": {"records": [], "synthetic": []}, "wait": [], "call": []}
    state = program.init_fn()
    step = 0
    for _ in range(_ROUNDS.value):
        for name, batch_fn in (("records", records), ("synthetic", synthetic)):
            for i in range(WARMUP_STEPS + _STEPS.value):  # batches alone, back to back
                began = time.perf_counter()
                jax.block_until_ready(batch_fn(step))
                if i >= WARMUP_STEPS:
                    out["batch"][name].append(time.perf_counter() - began)
                step += 1
            for i in range(WARMUP_STEPS + _STEPS.value):  # a train step after each batch
                began = time.perf_counter()
                batch = batch_fn(step)
                called = time.perf_counter() - began
                state, loss = program.step_fn(state, batch)
                jax.block_until_ready(loss)
                if i >= WARMUP_STEPS:
                    out["step"][name].append(time.perf_counter() - began)
                    if name == "records":
                        out["wait"].append(records.last_wait_secs)
                        out["call"].append(called)
                step += 1
    records.close()
    return out


def rows(result: dict) -> list[tuple[str, float]]:
    med = statistics.median
    batch_r, batch_s = med(result["batch"]["records"]), med(result["batch"]["synthetic"])
    step_r, step_s = med(result["step"]["records"]), med(result["step"]["synthetic"])
    return [
        ("batch alone: records, ms (median)", 1e3 * batch_r),
        ("batch alone: synthetic, ms (median)", 1e3 * batch_s),
        ("train step: records, ms (median)", 1e3 * step_r),
        ("train step: synthetic, ms (median)", 1e3 * step_s),
        ("records: input wait per step, ms (median)", 1e3 * med(result["wait"])),
        ("records: input wait per step, ms (max)", 1e3 * max(result["wait"])),
        ("records: batch call per step, ms (median)", 1e3 * med(result["call"])),
        ("ratio: batch alone records / synthetic", batch_r / batch_s),
        ("ratio: train step records / synthetic (target <= 1.05)", step_r / step_s),
    ]


def main(argv) -> None:
    if _CHILD.value:
        print(json.dumps(measure(_CHILD.value)), flush=True)
        return
    from trainer.input import corpus, shards

    meter = common.LoadMeter()
    folder = tempfile.mkdtemp(prefix="input_bench-")
    try:
        metadata = shards.prepare(corpus.default_corpus_dir(), f"{folder}/data", _SEQ_LEN.value,
                                  max_bytes=_MAX_BYTES.value, eval_fraction=0.0)
        passed = [f"--{name}={flags.FLAGS[name].value}" for name in
                  ("steps", "rounds", "batch_size", "seq_len", "hidden_dim")]
        result = common.run_child("benchmarks.input_bench", [f"--child_records={folder}/data/train-*.array_record",
                                                             *passed], devices=8)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"input benchmark: {metadata['splits']['train']['records']} records of {_SEQ_LEN.value + 1} tokens "
          f"({metadata['corpus']['files']} stdlib files), batch {_BATCH.value}, transformer width {_HIDDEN.value}, "
          f"mesh data=8 (fake CPU devices); other load {meter.other_cores():.2f} cores, "
          f"load average {meter.load_average_at_start[0]:.2f}")
    for label, value in rows(result):
        print(f"  {label:<58} {value:10.3f}")


if __name__ == "__main__":
    entry.run(main)
