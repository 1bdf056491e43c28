"""File-backed input: the position is the step, on real ArrayRecord files read through Grain."""

import hashlib
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests import records_util
from trainer import input as data_input
from trainer.input import shards

COUNTS = [7, 9, 7]  # 23 records in three files of unequal length
BATCH = 8


@pytest.fixture
def pattern(tmp_path):
    return records_util.write_files(str(tmp_path / "data"), COUNTS)


def mesh_of(shape: dict[str, int]):
    sizes = (shape.get("data", 1), shape.get("model", 1))
    devices = jax.devices()[: sizes[0] * sizes[1]]
    return jax.make_mesh(sizes, ("data", "model"), devices=devices)


def test_rows_of_step_is_a_permutation_per_epoch_with_exact_boundaries():
    num_records, batch = 23, 5
    steps = 3 * num_records // batch + 1  # 70 rows: three whole epochs and one row of the fourth
    rows = np.concatenate([data_input.rows_of_step(s, batch, num_records=num_records, seed=3) for s in range(steps)])
    epochs = [rows[e * num_records:(e + 1) * num_records] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(num_records))
    assert len({tuple(e.tolist()) for e in epochs}) == 3, "each epoch has its own order"
    straddling = data_input.rows_of_step(4, batch, num_records=num_records, seed=3)  # rows 20..24
    assert straddling.tolist() == rows[20:25].tolist()
    other_seed = data_input.rows_of_step(0, num_records, num_records=num_records, seed=4)
    assert other_seed.tolist() != epochs[0].tolist()


def test_batches_are_the_records_of_the_step_on_every_mesh(pattern):
    dataset = data_input.open_records(f"records:{pattern}", seed=1)
    assert dataset.num_records == sum(COUNTS) and dataset.record_shape == (records_util.TOKENS,)
    steps = range(3 * sum(COUNTS) // BATCH + 1)
    expected = [np.stack([records_util.record(i) for i in dataset.rows_of_step(s, BATCH)]) for s in steps]
    for shape in ({"data": 8}, {"data": 4, "model": 2}, {"data": 2}):
        sharding = NamedSharding(mesh_of(shape), P("data"))
        with data_input.RecordBatches(dataset, BATCH, sharding) as batches:
            got = [batches(s)["tokens"] for s in steps]
        assert all(g.sharding == sharding for g in got)
        assert [g.shape for g in got] == [(BATCH, records_util.TOKENS)] * len(got)
        assert [np.asarray(g).tolist() for g in got] == [e.tolist() for e in expected], shape


def test_a_restart_at_any_step_reads_the_same_rows(pattern):
    dataset = data_input.open_records(f"records:{pattern}", seed=0)
    sharding = NamedSharding(mesh_of({"data": 4, "model": 2}), P("data"))
    with data_input.RecordBatches(dataset, BATCH, sharding) as batches:
        straight = [np.asarray(batches(s)["tokens"]).tolist() for s in range(6)]
    with data_input.RecordBatches(dataset, BATCH, sharding) as batches:
        resumed = [np.asarray(batches(s)["tokens"]).tolist() for s in (3, 4, 5, 1, 2)]
    assert resumed == straight[3:6] + straight[1:3]


def test_a_process_reads_its_devices_rows_once(pattern):
    """Rows replicated over 'model' are read once; the count covers the read-ahead steps too."""
    dataset = data_input.open_records(f"records:{pattern}", seed=0)
    sharding = NamedSharding(mesh_of({"data": 4, "model": 2}), P("data"))
    batches = data_input.RecordBatches(dataset, BATCH, sharding, prefetch_steps=2)
    try:
        assert batches.ranges == [(0, 2), (2, 4), (4, 6), (6, 8)]
        for step in range(5):
            batches(step)
    finally:
        batches.close()
    assert batches.rows_per_step == BATCH
    assert batches.steps_read >= 5
    assert dataset.records_read == batches.steps_read * BATCH


def test_the_batch_function_of_a_flag_checks_the_model_sizes(tmp_path):
    metadata = stdlib_corpus(tmp_path, "corpus")
    pattern = f"records:{tmp_path}/corpus/train-*.array_record"
    sharding = NamedSharding(mesh_of({"data": 8}), P("data"))
    with data_input.record_batches(pattern, 0, BATCH, sharding, seq_len=32, vocab_size=257) as batches:
        assert batches(0)["tokens"].shape == (BATCH, metadata["tokens_per_record"])
    with pytest.raises(data_input.DataError, match="--seq_len=16: the records .* hold 33 tokens"):
        data_input.record_batches(pattern, 0, BATCH, sharding, seq_len=16, vocab_size=257)
    with pytest.raises(data_input.DataError, match="--vocab_size=64: .* a vocabulary of 257"):
        data_input.record_batches(pattern, 0, BATCH, sharding, seq_len=32, vocab_size=64)


def test_identity_names_the_changed_file_the_missing_file_and_the_seed(tmp_path, pattern):
    recorded = data_input.open_records(f"records:{pattern}", seed=5).identity()
    assert [f["name"] for f in recorded["files"]] == [f"train-{i:05d}.array_record" for i in range(3)]
    assert [f["records"] for f in recorded["files"]] == COUNTS
    data_input.check_same(recorded, data_input.open_records(f"records:{pattern}", seed=5).identity())

    moved = records_util.write_files(str(tmp_path / "elsewhere"), COUNTS)  # same files, another mount point
    data_input.check_same(recorded, data_input.open_records(f"records:{moved}", seed=5).identity())

    with pytest.raises(data_input.DatasetChangedError, match="seed"):
        data_input.check_same(recorded, data_input.open_records(f"records:{pattern}", seed=6).identity())

    folder = os.path.dirname(pattern)
    records_util.write_file(os.path.join(folder, "train-00001.array_record"), range(100, 109))  # same count
    with pytest.raises(data_input.DatasetChangedError, match="file train-00001.array_record: edges") as err:
        data_input.check_same(recorded, data_input.open_records(f"records:{pattern}", seed=5).identity())
    assert len(str(err.value).splitlines()) == 1

    records_util.write_file(os.path.join(folder, "train-00001.array_record"), range(7, 16))  # put back
    data_input.check_same(recorded, data_input.open_records(f"records:{pattern}", seed=5).identity())
    os.remove(os.path.join(folder, "train-00002.array_record"))
    with pytest.raises(data_input.DatasetChangedError, match="00002.array_record was .present., is now .missing."):
        data_input.check_same(recorded, data_input.open_records(f"records:{pattern}", seed=5).identity())


def test_a_glob_that_matches_nothing_and_a_bad_flag_are_one_line(tmp_path):
    with pytest.raises(data_input.NoRecordFilesError, match="matches no file") as err:
        data_input.open_records(f"records:{tmp_path}/none-*.array_record", seed=0)
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(data_input.DataError, match="expected records:<glob>"):
        data_input.open_records("synthetic", seed=0)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
def test_a_truncated_file_is_one_line_naming_it(pattern, keep):
    path = os.path.join(os.path.dirname(pattern), "train-00001.array_record")
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[: int(len(content) * keep)])
    with pytest.raises(data_input.RecordFileError) as err:
        data_input.open_records(f"records:{pattern}", seed=0)
    assert err.value.path == path
    assert str(err.value).startswith(path + ": ") and len(str(err.value).splitlines()) == 1


def test_damage_found_by_a_read_names_the_file(tmp_path):
    folder = str(tmp_path / "big")
    records_util.write_file(os.path.join(folder_made(folder), "train-00000.array_record"), range(20))
    damaged = os.path.join(folder, "train-00001.array_record")
    records_util.write_file(damaged, range(20, 20 + 30000))  # several chunks: the middle one is damaged
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        f.write(b"x" * 64)
    dataset = data_input.open_records(f"records:{folder}/train-*.array_record", seed=0)
    assert dataset.read([0, 5]).tolist() == [records_util.record(0).tolist(), records_util.record(5).tolist()]
    with pytest.raises(data_input.RecordFileError) as err:
        dataset.read(range(dataset.num_records))
    assert err.value.path == damaged and len(str(err.value).splitlines()) == 1


def test_damage_found_by_the_read_ahead_is_raised_by_the_step_that_needs_it(tmp_path):
    folder = folder_made(str(tmp_path / "big"))
    damaged = os.path.join(folder, "train-00000.array_record")
    records_util.write_file(damaged, range(30000))
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        f.write(b"x" * 64)
    dataset = data_input.open_records(f"records:{folder}/train-*.array_record", seed=0)
    sharding = NamedSharding(mesh_of({"data": 8}), P("data"))
    with data_input.RecordBatches(dataset, 4096, sharding) as batches:
        with pytest.raises(data_input.RecordFileError) as err:
            for step in range(8):  # 32768 rows: more than one epoch, so the damaged chunk is read
                batches(step)
    assert err.value.path == damaged and len(str(err.value).splitlines()) == 1


def folder_made(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    return folder


def stdlib_corpus(tmp_path, name: str, **options) -> dict:
    from trainer.input import corpus

    return shards.prepare(corpus.default_corpus_dir(), str(tmp_path / name), 32, max_files=12,
                          eval_fraction=0.25, records_per_shard=500, **options)


def folder_bytes(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def without_mtimes(metadata: dict) -> dict:
    """metadata.json but each shard's mtime_ns: a fact of this copy of the files, not of their content."""
    def shards_of(split: dict) -> list[dict]:
        return [{k: v for k, v in shard.items() if k != "mtime_ns"} for shard in split["shards"]]

    splits = {name: {**split, "shards": shards_of(split)} for name, split in metadata["splits"].items()}
    return {**metadata, "splits": splits}


def test_prepare_is_deterministic_and_splits_train_from_eval_by_file(tmp_path):
    first, second = stdlib_corpus(tmp_path, "a"), stdlib_corpus(tmp_path, "b")
    assert without_mtimes(first) == without_mtimes(second)
    shard_bytes = [{k: v for k, v in folder_bytes(str(tmp_path / name)).items() if k != "metadata.json"}
                   for name in ("a", "b")]
    assert shard_bytes[0] == shard_bytes[1]
    for split in first["splits"].values():  # each shard's recorded facts are those of its bytes on disk
        for shard in split["shards"]:
            path = os.path.join(tmp_path, "a", shard["name"])
            assert shard["sha256"] == hashlib.sha256(shard_bytes[0][shard["name"]]).hexdigest()
            assert (shard["size"], shard["mtime_ns"]) == (os.stat(path).st_size, os.stat(path).st_mtime_ns)
    assert first["vocab_size"] == 257 and first["tokens_per_record"] == 33
    assert first["splits"]["eval"]["source_files"] == 3 and first["splits"]["train"]["source_files"] == 9
    for split in ("train", "eval"):
        dataset = data_input.open_records(f"records:{tmp_path}/a/{split}-*.array_record", seed=0)
        assert dataset.num_records == first["splits"][split]["records"] > 0
        assert [f["records"] for f in dataset.files] == [s["records"] for s in first["splits"][split]["shards"]]
        assert dataset.metadata() == first
    train = data_input.open_records(f"records:{tmp_path}/a/train-*.array_record", seed=0)
    tokens = train.read(range(train.num_records)).reshape(-1)
    assert tokens.min() >= 0 and tokens.max() < 257
    text = bytes(t for t in tokens.tolist() if t != 256).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text  # Python sources, as bytes


def test_prepare_keeps_its_own_output_and_refuses_a_folder_that_holds_other_files(tmp_path):
    first = stdlib_corpus(tmp_path, "a")
    before = folder_bytes(str(tmp_path / "a"))
    assert stdlib_corpus(tmp_path, "a") == first  # the same arguments again: its own output, kept
    with pytest.raises(data_input.CorpusError, match="other arguments: --max_bytes=100000"):
        stdlib_corpus(tmp_path, "a", max_bytes=100000)
    assert folder_bytes(str(tmp_path / "a")) == before
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(data_input.CorpusError, match="not an empty folder, nor prepare's finished output"):
        stdlib_corpus(tmp_path, "b")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"], "no staging folder left behind"
