"""The data's identity is its content: each record file's sha256, taken from prepare's metadata or this
host's digest cache while the file's size and mtime vouch for it, else hashed (--check_data=full: always).
A resume on other bytes is refused naming the file, unless --accept_data_change, which the manifests record;
a run recorded before content digests still resumes (docs/data.md#the-datasets-identity)."""

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest
from array_record.python import array_record_module

from checkpointing import committed_steps, read_manifest, verdicts
from tests import helpers, records_util
from tests.records_train import lm_flags
from trainer import data, train
from trainer import input as data_input
from trainer.input import corpus as corpus_lib
from trainer.input import digests, records, shards

MESH = "--mesh=data=4,model=2"
SHARD = "train-00001-of-00003.array_record"
TRAIN = ["--save_every_steps=8", "--max_to_keep=100", "--log_every_steps=4"]


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> str:
    """This test's own digest cache (digests.default_cache_dir reads XDG_CACHE_HOME at each open)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return os.path.join(tmp_path, "cache", "jax-checkpoint-service", "data-digests")


def read_all(path: str) -> list[bytes]:
    reader = array_record_module.ArrayRecordReader(path)
    try:
        return reader.read(list(range(reader.num_records())))
    finally:
        reader.close()


def write_all(path: str, rows: list[bytes]) -> None:
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for row in rows:
        writer.write(row)
    writer.close()


def swap_two_tokens(path: str) -> None:
    """Rewrites `path` with two neighbouring, different tokens of its middle record swapped: the same
    size, record count and first and last records (what identified a file before content digests)."""
    before, rows = os.stat(path), read_all(path)
    middle = len(rows) // 2
    tokens = np.frombuffer(rows[middle], "<i4").copy()
    i = int(np.flatnonzero(tokens[:-1] != tokens[1:])[0])
    tokens[[i, i + 1]] = tokens[[i + 1, i]]
    write_all(path, [*rows[:middle], tokens.tobytes(), *rows[middle + 1:]])
    after, swapped = os.stat(path), read_all(path)
    assert (after.st_size, len(swapped), swapped[0], swapped[-1]) == (before.st_size, len(rows), rows[0], rows[-1])
    assert swapped[middle] != rows[middle] and after.st_mtime_ns != before.st_mtime_ns, "a real write"


def open_train(folder: str, check: str = digests.STAT) -> records.RecordDataset:
    return data_input.open_records(f"records:{folder}/train-*.array_record", seed=0, check_data=check)


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepared(tmp_path, name: str = "corpus") -> str:
    folder = str(tmp_path / name)
    shards.prepare(corpus_lib.default_corpus_dir(), folder, 32, max_files=6, eval_fraction=0.25,
                              records_per_shard=100)
    return folder


def test_prepare_vouches_for_its_shards_until_one_is_written(tmp_path):
    folder = prepared(tmp_path)
    dataset = open_train(folder)
    assert (dataset.digest_tally.metadata, dataset.digest_tally.hashed) == (3, 0)
    assert [f["sha256"] for f in dataset.files] == [sha256_of(p) for p in dataset.paths]

    swap_two_tokens(os.path.join(folder, SHARD))
    changed = open_train(folder)
    assert (changed.digest_tally.metadata, changed.digest_tally.hashed) == (2, 1), "only the written shard"
    with pytest.raises(data_input.ContentChangedError, match=f"file {SHARD}: its content changed") as err:
        data_input.check_same(dataset.identity(), changed.identity())
    assert len(str(err.value).splitlines()) == 1 and err.value.name == SHARD
    assert changed.identity()["digest"] != dataset.identity()["digest"]


def test_a_users_own_files_are_hashed_once_then_vouched_for_by_the_cache(tmp_path, digest_cache):
    pattern = records_util.write_files(str(tmp_path / "data"), [7, 9, 7])  # no prepare, no metadata.json
    opened = lambda: data_input.open_records(f"records:{pattern}", seed=0)  # noqa: E731
    first = opened()
    assert (first.digest_tally.hashed, first.digest_tally.cache) == (3, 0)
    again = opened()
    assert (again.digest_tally.hashed, again.digest_tally.cache) == (0, 3)
    data_input.check_same(first.identity(), again.identity())

    gone = records_util.write_files(str(tmp_path / "gone"), [2])
    data_input.open_records(f"records:{gone}", seed=0)
    assert len(os.listdir(digest_cache)) == 2
    shutil.rmtree(tmp_path / "gone")
    path = os.path.join(tmp_path, "data", "train-00001.array_record")
    swap_two_tokens(path)
    changed = opened()
    assert (changed.digest_tally.hashed, changed.digest_tally.cache) == (1, 2)
    assert changed.files[1]["sha256"] == sha256_of(path)
    with pytest.raises(data_input.ContentChangedError, match="file train-00001.array_record: its content changed"):
        data_input.check_same(first.identity(), changed.identity())
    assert len(os.listdir(digest_cache)) == 1, "the cache of a folder that is gone is dropped"


def test_only_full_sees_an_edit_that_restored_the_size_and_the_mtime(tmp_path):
    folder = prepared(tmp_path)
    recorded = open_train(folder).identity()
    path = os.path.join(folder, SHARD)
    before = os.stat(path)
    swap_two_tokens(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r: the mtime prepare recorded

    by_stat = open_train(folder)
    assert by_stat.digest_tally.hashed == 0
    data_input.check_same(recorded, by_stat.identity())  # the documented limit of the cheap check
    full = open_train(folder, digests.FULL)
    assert (full.digest_tally.hashed, full.digest_tally.metadata) == (3, 0)
    with pytest.raises(data_input.ContentChangedError, match=f"file {SHARD}: its content changed"):
        data_input.check_same(recorded, full.identity())


def legacy_identity(dataset: records.RecordDataset) -> dict:
    """What RecordDataset.identity recorded before content digests (name, size, records, edges)."""
    files = [{key: f[key] for key in ("name", "size", "records", "edges")} for f in dataset.files]
    digest = hashlib.sha256(json.dumps([files, dataset.record_bytes], sort_keys=True).encode()).hexdigest()
    return {"files": files, "record_bytes": dataset.record_bytes, "num_records": dataset.num_records,
            "digest": digest, "seed": dataset.seed}


def test_an_identity_recorded_before_content_digests_is_compared_without_them(tmp_path):
    folder = prepared(tmp_path)
    old = legacy_identity(open_train(folder))
    assert not data_input.has_content(old)
    data_input.check_same(old, open_train(folder).identity())  # a missing sha256 is not a change
    os.remove(os.path.join(folder, SHARD))
    with pytest.raises(data_input.DatasetChangedError, match=f"file {SHARD} was 'present', is now 'missing'"):
        data_input.check_same(old, open_train(folder).identity())


def test_an_unusable_digest_cache_costs_a_hash_not_the_run(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    pattern = records_util.write_files(str(tmp_path / "data"), [3, 4])
    for _ in range(2):
        dataset = data_input.open_records(f"records:{pattern}", seed=0)
        assert dataset.digest_tally.hashed == 2 and len(dataset.digest_tally.notes) == 1
    assert "not written" in dataset.digest_tally.notes[0]


def test_check_data_takes_the_digests_values_and_refuses_another(tmp_path):
    assert data.CHECK_DATA == digests.CHECKS
    run = str(tmp_path / "run")
    result = helpers.run_in_process(train.main, f"--workdir={run}", MESH, "--check_data=quick")
    helpers.assert_refused(result, helpers.disk_state(run), "--check_data=quick: expected stat or full")


# --- real trainer runs -----------------------------------------------------------------------------


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
    swap_two_tokens(path)
    refused(workdir, corpus, expected=(f"file {SHARD}: its content changed", "--accept_data_change"))
    Verifier, VerifierOptions = verifier_classes()
    Verifier(VerifierOptions(workdir=workdir, mesh=(("data", 8),))).verify_pending()
    verdict = verdicts.read_all(workdir)[8]
    assert verdict["status"] == "fail" and f"file {SHARD}: its content changed" in verdict["detail"], verdict

    logged(caplog)
    trained(workdir, corpus, 16, "--accept_data_change")
    assert f"--accept_data_change: file {SHARD}: its content changed" in logged(caplog)
    was, now = read_manifest(workdir, 8), read_manifest(workdir, 16)
    identity = now["config"]["data_identity"]
    assert identity["accepted_change"] == {"step": 8, "digest": was["config"]["data_identity"]["digest"],
                                           "change": identity["accepted_change"]["change"]}
    assert SHARD in identity["accepted_change"]["change"]
    assert identity["files"][1]["sha256"] == sha256_of(path) != was["config"]["data_identity"]["files"][1]["sha256"]
    assert now["fixed_fields"]["data_digest"] == was["fixed_fields"]["data_digest"], "the run's, kept"
    trained(workdir, corpus, 24)  # the newest manifest recorded the files as they are: no flag needed
    assert "accepted_change" not in read_manifest(workdir, 24)["config"]["data_identity"]


def verifier_classes():
    from verifier.verifier import Verifier, VerifierOptions  # noqa: PLC0415  (the slow test alone loads it)

    return Verifier, VerifierOptions


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
    swap_two_tokens(path)
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
        old_code.setattr(records.RecordDataset, "identity", legacy_identity)
        trained(workdir, corpus, 8)
    old = read_manifest(workdir, 8)
    assert not data_input.has_content(old["config"]["data_identity"])
    logged(caplog)
    trained(workdir, corpus, 16)
    assert "step 8's manifest names the files by name, size, record count and edge records only" in logged(caplog)
    new = read_manifest(workdir, 16)
    assert data_input.has_content(new["config"]["data_identity"])
    assert new["fixed_fields"] == old["fixed_fields"], "the run's fixed data_digest is kept"
    swap_two_tokens(os.path.join(corpus, SHARD))
    refused(workdir, corpus, expected=(f"file {SHARD}: its content changed",))
