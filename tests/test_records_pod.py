"""Record batches on real pods and the prepare command line: processes, so the slow tier."""

import json
import os
import subprocess

import pytest

from tests import helpers, records_util
from trainer import input as data_input

pytestmark = pytest.mark.slow

BATCH, STEPS = 8, 6


def run_pod(pattern: str, mesh: str) -> list[dict]:
    flags = [f"--pattern={pattern}", f"--mesh={mesh}", f"--batch_size={BATCH}", f"--steps={STEPS}"]
    results = helpers.pod_results("tests.records_pod_driver", num_processes=2, devices_per_process=4, flags=flags)
    return [results[index] for index in sorted(results)]


@pytest.mark.parametrize("mesh", ["data=8", "data=4,model=2"])
def test_each_process_of_a_pod_reads_only_its_rows_and_the_pod_sees_the_global_batch(tmp_path, mesh):
    pattern = records_util.write_files(str(tmp_path / "data"), [7, 9, 7])
    dataset = data_input.open_records(f"records:{pattern}", seed=0)
    expected = [(dataset.rows_of_step(s, BATCH) * 1000).tolist() for s in range(STEPS)]  # record i starts i*1000
    reports = run_pod(pattern, mesh)
    assert [r["process"] for r in reports] == [0, 1]
    for report in reports:
        assert report["batches"] == expected
        rows = sum(stop - start for start, stop in report["ranges"])
        assert rows == BATCH // 2, report["ranges"]  # half the rows: the other process reads the rest
        assert report["steps_read"] >= STEPS
        assert report["records_read"] == report["steps_read"] * rows
    held = [tuple(r) for report in reports for r in report["ranges"]]
    assert sorted(held) == sorted(set(held)), "no row is read by two processes"
    assert sum(stop - start for start, stop in held) == BATCH


def prepare_command(*flags: str) -> subprocess.CompletedProcess:
    return helpers.run_module("trainer.prepare", *flags, timeout=120)


@pytest.mark.parametrize("flags, expected", [
    (["--corpus_dir={tmp}/absent", "--seq_len=8"], "not a directory"),
    (["--corpus_dir={tmp}/empty", "--seq_len=8"], "no UTF-8 text files"),
    (["--seq_len=0", "--max_files=3"], "--seq_len=0: must be at least 1"),
    (["--seq_len=100000000", "--max_files=3"], "fewer than 100000001 tokens"),
    (["--seq_len=8", "--max_files=1", "--eval_fraction=0.5"], "needs at least 2 files"),
    (["--seq_len=8", "--tokenizer=sentencepiece", "--vocab_size=10", "--max_files=3"], "at least 260"),
    (["--max_files=3"], "--out_dir and --seq_len are required"),
])
def test_prepare_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, flags, expected):
    os.makedirs(tmp_path / "empty" / "sub")
    with open(tmp_path / "empty" / "notes.bin", "wb") as f:
        f.write(b"\xff\xfe")
    before = sorted(os.listdir(tmp_path))
    result = prepare_command(f"--out_dir={tmp_path}/out", *(f.format(tmp=tmp_path) for f in flags))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert result.stdout == ""
    assert sorted(os.listdir(tmp_path)) == before, "nothing written"


def test_prepare_command_with_sentencepiece_is_deterministic(tmp_path):
    flags = ["--seq_len=32", "--tokenizer=sentencepiece", "--vocab_size=400", "--max_bytes=300000",
             "--eval_fraction=0.2", "--records_per_shard=2000"]
    for name in ("a", "b"):
        result = prepare_command(f"--out_dir={tmp_path}/{name}", *flags)
        assert result.returncode == 0, result.stderr
    contents = []
    for name in ("a", "b"):
        folder = tmp_path / name
        contents.append({f: (folder / f).read_bytes() for f in sorted(os.listdir(folder)) if f != "metadata.json"})
    assert contents[0] == contents[1]
    assert "tokenizer.model" in contents[0]
    with open(tmp_path / "a" / "metadata.json") as f:
        metadata = json.load(f)
    assert metadata["tokenizer"] == "sentencepiece" and metadata["vocab_size"] == 400
    train = data_input.open_records(f"records:{tmp_path}/a/train-*.array_record", seed=0)
    tokens = train.read(range(train.num_records))
    assert train.num_records == metadata["splits"]["train"]["records"] and tokens.shape[1] == 33
    assert 0 <= tokens.min() and tokens.max() < 400
