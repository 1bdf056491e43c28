"""The trainer resumes only on the bytes it trained on (docs/data.md#the-datasets-identity): a resume on
other bytes is refused naming the file, unless --accept_data_change, which the manifests record; a run
recorded before content digests still resumes. Real corpus, real trainer runs, the real verifier."""

import json
import logging
import os
import shutil

import pytest

from checkpointing._src.workdir import committed_steps, read_manifest
from checkpointing._src import verdicts
from tests import helpers, records_util
from tests.records_train import lm_flags
from trainer import input as data_input
from trainer import train
from trainer.input import corpus as corpus_lib
from trainer.input import records
from verifier.verifier import Verifier, VerifierOptions

MESH = "--mesh=data=4,model=2"
SHARD = "train-00001-of-00003.array_record"
TRAIN = ["--save_every_steps=8", "--max_to_keep=100", "--log_every_steps=4"]


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> str:
    """This test's own digest cache (digests.default_cache_dir reads XDG_CACHE_HOME at each open)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return os.path.join(tmp_path, "cache", "jax-checkpoint-service", "data-digests")


def copied(stdlib_corpus, tmp_path) -> str:
    corpus = str(tmp_path / "corpus")
    shutil.copytree(stdlib_corpus, corpus)  # copy2 keeps the mtimes prepare recorded
    return corpus


def trained(workdir: str, corpus: str, steps: int, *flags: str) -> None:
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", MESH, f"--steps={steps}", *lm_flags(corpus),
                                    *TRAIN, "--verbosity=0", *flags)  # INFO, as `python -m` logs it
    assert result.returncode == 0, result.stderr[-3000:]


def logged(caplog) -> str:
    """The log lines since the last call, one per line (absl's records reach caplog; stderr is the error's)."""
    lines = "\n".join(record.getMessage() for record in caplog.records)
    caplog.clear()
    return lines


def refused(workdir: str, corpus: str, *flags: str, expected: tuple[str, ...]) -> str:
    before = helpers.disk_state(workdir, corpus)
    result = helpers.run_in_process(train.main, f"--workdir={workdir}", MESH, "--steps=16", *lm_flags(corpus),
                                    *TRAIN, *flags)
    return helpers.assert_refused(result, before, *expected)


@pytest.mark.slow
def test_two_tokens_swapped_inside_a_record_refuse_the_resume_unless_accepted(tmp_path, stdlib_corpus, caplog):
    caplog.set_level(logging.INFO)
    corpus, workdir = copied(stdlib_corpus, tmp_path), str(tmp_path / "run")
    trained(workdir, corpus, 8)
    path = os.path.join(corpus, SHARD)
    records_util.swap_two_tokens(path)
    refused(workdir, corpus, expected=(f"file {SHARD}: its content changed", "--accept_data_change"))
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),))).verify_pending()
    verdict = verdicts.read_all(workdir)[8]
    # Not the checkpoint's fault: the replay cannot run on other data (an error, retried by the next verifier run).
    assert (verdict["status"], verdict["complete"]) == ("error", False), verdict
    assert f"file {SHARD}: its content changed" in verdict["detail"], verdict

    logged(caplog)
    trained(workdir, corpus, 16, "--accept_data_change")
    assert f"--accept_data_change: file {SHARD}: its content changed" in logged(caplog)
    was, now = read_manifest(workdir, 8), read_manifest(workdir, 16)
    identity = now["config"]["data_identity"]
    assert identity["accepted_change"] == {"step": 8, "digest": was["config"]["data_identity"]["digest"],
                                           "change": identity["accepted_change"]["change"]}
    assert SHARD in identity["accepted_change"]["change"]
    sha_was = was["config"]["data_identity"]["files"][1]["sha256"]
    assert identity["files"][1]["sha256"] == records_util.sha256_of(path) != sha_was
    assert now["fixed_fields"]["data_digest"] == was["fixed_fields"]["data_digest"], "the run's, kept"
    trained(workdir, corpus, 24)  # the newest manifest recorded the files as they are: no flag needed
    assert "accepted_change" not in read_manifest(workdir, 24)["config"]["data_identity"]


@pytest.mark.slow
def test_a_one_character_edit_and_a_fresh_prepare_refuse_the_resume(tmp_path):
    texts = str(tmp_path / "texts")
    documents, _ = corpus_lib.read_corpus(corpus_lib.default_corpus_dir(), (".py",), max_files=6)
    for document in documents:
        os.makedirs(os.path.dirname(os.path.join(texts, document.name)), exist_ok=True)
        with open(os.path.join(texts, document.name), "w", encoding="utf-8") as f:
            f.write(document.text)
    out, workdir = str(tmp_path / "prepared"), str(tmp_path / "run")
    prepare_flags = [f"--corpus_dir={texts}", f"--out_dir={out}", "--seq_len=32", "--eval_fraction=0.25",
                     "--records_per_shard=100"]
    prepared_first = helpers.run_module("trainer.prepare", *prepare_flags)  # python -m, as a user runs it
    assert prepared_first.returncode == 0, prepared_first.stderr
    with open(os.path.join(out, "metadata.json")) as f:
        first = json.load(f)
    trained(workdir, out, 8)

    train_docs, _ = corpus_lib.split(documents, 0.25)
    document = next(d for d in train_docs if "import " in d.text)
    edited, text = os.path.join(texts, document.name), document.text
    at = text.index("import ")  # 'import' -> 'imqort': one character, the same length
    with open(edited, "w", encoding="utf-8") as f:
        f.write(text[:at + 2] + "q" + text[at + 3:])
    shutil.rmtree(out)
    prepared_again = helpers.run_module("trainer.prepare", *prepare_flags)
    assert prepared_again.returncode == 0, prepared_again.stderr
    with open(os.path.join(out, "metadata.json")) as f:
        second = json.load(f)
    shas = lambda m: {s["name"]: s["sha256"] for s in m["splits"]["train"]["shards"]}  # noqa: E731
    changed = [name for name in shas(first) if shas(first)[name] != shas(second)[name]]
    assert len(changed) == 1 and first["splits"]["train"]["records"] == second["splits"]["train"]["records"]
    refused(workdir, out, expected=(f"file {changed[0]}: its content changed",))


@pytest.mark.slow
def test_check_data_full_refuses_an_edit_that_restored_the_mtime(tmp_path, stdlib_corpus):
    corpus, workdir = copied(stdlib_corpus, tmp_path), str(tmp_path / "run")
    trained(workdir, corpus, 8)
    path = os.path.join(corpus, SHARD)
    before = os.stat(path)
    records_util.swap_two_tokens(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    refused(workdir, corpus, "--check_data=full", expected=(f"file {SHARD}: its content changed",))


@pytest.mark.slow
def test_unchanged_data_resumes_and_only_a_written_shard_is_hashed_again(tmp_path, stdlib_corpus, caplog):
    caplog.set_level(logging.INFO)
    corpus, workdir = copied(stdlib_corpus, tmp_path), str(tmp_path / "run")
    trained(workdir, corpus, 8)
    logged(caplog)
    trained(workdir, corpus, 16)
    lines = logged(caplog)
    assert "--data content (sha256) of 3 files: 3 from prepare's metadata.json, 0 from the digest cache, " \
           "0 hashed" in lines, lines
    assert "--eval_data content (sha256) of 1 files: 1 from prepare's metadata.json" in lines
    path = os.path.join(corpus, SHARD)
    now = os.stat(path)
    os.utime(path, ns=(now.st_atime_ns, now.st_mtime_ns + 10**9))  # written, the same bytes
    trained(workdir, corpus, 24)
    assert "2 from prepare's metadata.json, 0 from the digest cache, 1 hashed" in logged(caplog)
    trained(workdir, corpus, 32)
    assert "2 from prepare's metadata.json, 1 from the digest cache, 0 hashed" in logged(caplog)
    assert committed_steps(workdir) == [8, 16, 24, 32]


@pytest.mark.slow
def test_a_run_recorded_before_content_digests_resumes_and_is_identified_by_content_from_then_on(
        tmp_path, stdlib_corpus, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    corpus, workdir = copied(stdlib_corpus, tmp_path), str(tmp_path / "run")
    with monkeypatch.context() as old_code:
        old_code.setattr(records.RecordDataset, "identity", records_util.legacy_identity)
        trained(workdir, corpus, 8)
    old = read_manifest(workdir, 8)
    assert not data_input.has_content(old["config"]["data_identity"])
    logged(caplog)
    trained(workdir, corpus, 16)
    assert "step 8's manifest names the files by name, size, record count and edge records only" in logged(caplog)
    new = read_manifest(workdir, 16)
    assert data_input.has_content(new["config"]["data_identity"])
    assert new["fixed_fields"] == old["fixed_fields"], "the run's fixed data_digest is kept"
    records_util.swap_two_tokens(os.path.join(corpus, SHARD))
    refused(workdir, corpus, expected=(f"file {SHARD}: its content changed",))
