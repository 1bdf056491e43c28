"""The trainer on record files (--data=records:...): bad data is refused at start-up by name (exit 2,
one line, nothing changed), and a resume or a replay on other files than the run trained on is
refused naming the file (the trainer), or leaves the step unproved naming it (the verifier: an `error`, its
next run retries it; the checkpoint is not at fault)."""

import os
import shutil

import numpy as np
import pytest
from array_record.python import array_record_module

from checkpointing._src.workdir import committed_steps, read_manifest
from checkpointing._src import verdicts
from tests import helpers
from tests.records_train import eval_losses, lm_flags
from trainer import loop, model_config, train
from trainer.program import validate
from verifier.verifier import Verifier, VerifierOptions

MESH = "--mesh=data=4,model=2"


def copy_corpus(stdlib_corpus, tmp_path) -> str:
    corpus = str(tmp_path / "corpus")
    shutil.copytree(stdlib_corpus, corpus)
    return corpus


def refused(workdir: str, corpus: str, *flags: str, expected: tuple[str, ...]) -> str:
    before = helpers.disk_state(workdir, corpus)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", MESH, "--steps=16", *lm_flags(corpus), *flags)
    return helpers.assert_refused(result, before, *expected)


def test_a_glob_that_matches_nothing_is_refused(tmp_path, stdlib_corpus):
    line = refused(str(tmp_path / "run"), stdlib_corpus, f"--data=records:{tmp_path}/nothing-*.array_record",
                   expected=("the glob matches no file",))
    assert "nothing-*.array_record" in line


def test_a_truncated_record_file_is_refused_naming_it(tmp_path, stdlib_corpus):
    corpus = copy_corpus(stdlib_corpus, tmp_path)
    path = os.path.join(corpus, "train-00001-of-00003.array_record")
    os.truncate(path, os.path.getsize(path) // 2)
    refused(str(tmp_path / "run"), corpus, expected=(path,))


@pytest.mark.parametrize("flags, expected", [
    (["--seq_len=16"], "--seq_len=16: the records of"),
    (["--vocab_size=64"], "--vocab_size=64: the records of"),
    (["--model=mlp", "--seq_len=32"], "--model=mlp reads batches"),
    (["--eval_data="], "--eval_every_steps=8 needs --eval_data"),
    (["--data=train.array_record"], "--data=train.array_record: expected synthetic or records:<glob>"),
])
def test_records_the_model_cannot_read_are_refused_by_flag(tmp_path, stdlib_corpus, flags, expected):
    refused(str(tmp_path / "run"), stdlib_corpus, *flags, expected=(expected,))


def train_records(workdir: str, corpus: str, steps: int) -> loop.TrainResult:
    flags = dict(flag[2:].split("=", 1) for flag in lm_flags(corpus))
    numbers = {k: int(v) for k, v in flags.items() if k not in ("model", "data", "eval_data")}
    config = model_config.from_flat({**flags, **numbers, "workdir": workdir, "mesh": helpers.MESHES["data=4,model=2"],
                                    "steps": steps, "save_every_steps": 8, "max_to_keep": 100, "log_every_steps": 4})
    return loop.train(validate(config, 8))


def rewrite_reversed(path: str) -> None:
    """The same records in the opposite order: same size and count, other first and last records."""
    reader = array_record_module.ArrayRecordReader(path)
    records = reader.read(list(range(reader.num_records())))
    reader.close()
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for record in reversed(records):
        writer.write(record)
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage, named", [("changed", "train-00001-of-00003.array_record: edges"),
                                           ("missing", "file train-00002-of-00003.array_record")])
def test_other_files_refuse_the_resume_and_fail_the_verdict_by_name(tmp_path, stdlib_corpus, damage, named):
    corpus, workdir = copy_corpus(stdlib_corpus, tmp_path), str(tmp_path / "run")
    result = train_records(workdir, corpus, steps=8)
    assert committed_steps(workdir) == [8] and np.isfinite(result.losses[7])
    manifest = read_manifest(workdir, 8)
    assert manifest["config"]["data_identity"]["num_records"] == 270
    assert manifest["fixed_fields"]["data_digest"] == manifest["config"]["data_identity"]["digest"]
    assert list(eval_losses(workdir)) == [8]
    if damage == "changed":
        rewrite_reversed(os.path.join(corpus, "train-00001-of-00003.array_record"))
    else:
        os.remove(os.path.join(corpus, "train-00002-of-00003.array_record"))
    line = refused(workdir, corpus, expected=("the dataset changed since it was recorded", named))
    assert line.count("\n") == 0
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),))).verify_pending()
    verdict = verdicts.read_all(workdir)[8]
    assert (verdict["status"], verdict["complete"]) == ("error", False) and named in verdict["detail"], verdict


@pytest.mark.slow
def test_another_eval_split_refuses_the_resume_by_name_and_changes_nothing(tmp_path, stdlib_corpus):
    corpus, workdir = copy_corpus(stdlib_corpus, tmp_path), str(tmp_path / "run")
    train_records(workdir, corpus, steps=8)
    manifest = read_manifest(workdir, 8)
    eval_identity = manifest["config"]["eval_data_identity"]
    assert manifest["fixed_fields"]["eval_data_digest"] == eval_identity["digest"]
    assert manifest["fixed_fields"]["eval_batches"] == 2
    eval_file = eval_identity["files"][0]["name"]
    line = refused(workdir, corpus, f"--eval_data=records:{os.path.join(corpus, 'train-00000-of-00003.array_record')}",
                   expected=("the dataset changed since it was recorded", f"--eval_data: file {eval_file}"))
    assert line.count("\n") == 0
    refused(workdir, corpus, "--eval_data=", "--eval_every_steps=0", expected=("--eval_data (step 8)",))
    refused(workdir, corpus, "--eval_batches=3", expected=("--eval_batches (step 8) was 2, is now 3",))
    rewrite_reversed(os.path.join(corpus, eval_file))  # the same file name and size, other records
    refused(workdir, corpus, expected=(f"--eval_data: file {eval_file}: edges",))
