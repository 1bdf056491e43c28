"""The data's identity is its content (docs/data.md#the-datasets-identity), on real ArrayRecord files:
each file's sha256, taken from prepare's metadata or this host's digest cache while the file's size and
mtime vouch for it, else hashed (--check_data=full: always). tests/test_data_identity_train.py has the
trainer's resumes."""

import os
import shutil

import pytest

from tests import helpers, records_util
from trainer import data, train
from trainer import input as data_input
from trainer.input import corpus as corpus_lib
from trainer.input import digests, records, shards

MESH = "--mesh=data=4,model=2"
SHARD = "train-00001-of-00003.array_record"


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch) -> str:
    """This test's own digest cache (digests.default_cache_dir reads XDG_CACHE_HOME at each open)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return os.path.join(tmp_path, "cache", "jax-checkpoint-service", "data-digests")


def open_train(folder: str, check: str = digests.STAT) -> records.RecordDataset:
    return data_input.open_records(f"records:{folder}/train-*.array_record", seed=0, check_data=check)


def prepared(tmp_path, name: str = "corpus") -> str:
    folder = str(tmp_path / name)
    shards.prepare(corpus_lib.default_corpus_dir(), folder, 32, max_files=6, eval_fraction=0.25,
                   records_per_shard=100)
    return folder


def test_prepare_vouches_for_its_shards_until_one_is_written(tmp_path):
    folder = prepared(tmp_path)
    dataset = open_train(folder)
    assert (dataset.digest_tally.metadata, dataset.digest_tally.hashed) == (3, 0)
    assert [f["sha256"] for f in dataset.files] == [records_util.sha256_of(p) for p in dataset.paths]

    records_util.swap_two_tokens(os.path.join(folder, SHARD))
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
    records_util.swap_two_tokens(path)
    changed = opened()
    assert (changed.digest_tally.hashed, changed.digest_tally.cache) == (1, 2)
    assert changed.files[1]["sha256"] == records_util.sha256_of(path)
    with pytest.raises(data_input.ContentChangedError, match="file train-00001.array_record: its content changed"):
        data_input.check_same(first.identity(), changed.identity())
    assert len(os.listdir(digest_cache)) == 1, "the cache of a folder that is gone is dropped"


def test_only_full_sees_an_edit_that_restored_the_size_and_the_mtime(tmp_path):
    folder = prepared(tmp_path)
    recorded = open_train(folder).identity()
    path = os.path.join(folder, SHARD)
    before = os.stat(path)
    records_util.swap_two_tokens(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r: the mtime prepare recorded

    by_stat = open_train(folder)
    assert by_stat.digest_tally.hashed == 0
    data_input.check_same(recorded, by_stat.identity())  # the documented limit of the cheap check
    full = open_train(folder, digests.FULL)
    assert (full.digest_tally.hashed, full.digest_tally.metadata) == (3, 0)
    assert [note for note in full.digest_tally.notes if "differ from the sha256 prepare recorded" in note] == [
        f"{path}: its bytes differ from the sha256 prepare recorded for its size and mtime (an edit that put the "
        "mtime back?)"]
    with pytest.raises(data_input.ContentChangedError, match=f"file {SHARD}: its content changed"):
        data_input.check_same(recorded, full.identity())


def test_an_identity_recorded_before_content_digests_is_compared_without_them(tmp_path):
    folder = prepared(tmp_path)
    old = records_util.legacy_identity(open_train(folder))
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
