"""prepare's output: fixed-length token sequences in ArrayRecord shards, and metadata.json.

Each record is seq_len + 1 int32 tokens (little-endian): the model reads tokens[:-1] and predicts
tokens[1:], so a record feeds one example of the trainer's --seq_len. A split's token stream is cut
into consecutive non-overlapping records; the tail shorter than a record is dropped. Shards are
`<split>-00000-of-0000N.array_record`, `group_size:1` (Grain reads single records fast).
metadata.json lists each split's shards with their record counts and content facts (size, mtime_ns,
sha256 of the bytes): the trainer trusts a shard's recorded digest while its size and mtime are these.

Nothing is written on bad input: everything is computed and checked first, then written into a
temporary folder next to --out_dir that is renamed onto it, so --out_dir holds all or nothing.
"""

import json
import math
import os
import shutil
import tempfile

import numpy as np
from absl import logging
from array_record.python import array_record_module

from trainer.input import corpus as corpus_lib
from trainer.input import digests
from trainer.input.errors import CorpusError
from trainer.input.records import METADATA, TOKEN_DTYPE

WRITER_OPTIONS = "group_size:1"
SPLITS = ("train", "eval")


def to_records(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """(n, seq_len + 1) int32: the stream cut into consecutive records."""
    width = seq_len + 1
    count = len(stream) // width
    return np.ascontiguousarray(stream[: count * width].reshape(count, width), dtype=TOKEN_DTYPE)


def shard_names(split: str, count: int) -> list[str]:
    return [f"{split}-{i:05d}-of-{count:05d}.array_record" for i in range(count)]


def write_shard(path: str, rows: np.ndarray) -> dict:
    """Writes one shard; returns its record count and what prepare records of its content (size,
    mtime_ns, sha256: trainer/input/digests.py), which lets a start-up trust the shard without reading it."""
    writer = array_record_module.ArrayRecordWriter(path, WRITER_OPTIONS)
    try:
        for row in rows:
            writer.write(row.tobytes())
    finally:
        writer.close()
    return {"name": os.path.basename(path), "records": len(rows), **digests.shard_facts(path)}


def write_split(folder: str, split: str, records: np.ndarray, records_per_shard: int) -> list[dict]:
    count = max(1, math.ceil(len(records) / records_per_shard))
    return [write_shard(os.path.join(folder, name), records[i * records_per_shard:(i + 1) * records_per_shard])
            for i, name in enumerate(shard_names(split, count))]


def prepare(corpus_dir: str, out_dir: str, seq_len: int, *, tokenizer: str = "bytes", vocab_size: int = 1024,
            eval_fraction: float = 0.05, suffixes: tuple[str, ...] = (".py",), max_files: int | None = None,
            max_bytes: int | None = None, records_per_shard: int = 4096) -> dict:
    """Writes the shards and metadata.json into out_dir (which must not exist or be empty); returns the metadata.
    An out_dir that holds this function's finished output of the same arguments and corpus is left as it is
    (its metadata returned); any other content is a CorpusError."""
    if seq_len < 1:
        raise CorpusError(f"--seq_len={seq_len}: must be at least 1")
    if records_per_shard < 1:
        raise CorpusError(f"--records_per_shard={records_per_shard}: must be at least 1")
    for name, bound in (("max_files", max_files), ("max_bytes", max_bytes)):
        if bound is not None and bound < 1:
            raise CorpusError(f"--{name}={bound}: must be at least 1")
    arguments = {"corpus_dir": os.path.abspath(corpus_dir), "seq_len": seq_len, "tokenizer": tokenizer,
                 "vocab_size": vocab_size if tokenizer != "bytes" else None, "eval_fraction": eval_fraction,
                 "suffixes": list(suffixes), "max_files": max_files, "max_bytes": max_bytes,
                 "records_per_shard": records_per_shard}
    documents, skipped = corpus_lib.read_corpus(corpus_dir, suffixes, max_files, max_bytes)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        # A command line that prepares and then trains is run again: its own finished output of the same
        # arguments and corpus is the answer, not an error; anything else in --out_dir is never touched.
        metadata = finished_output(out_dir, arguments, corpus_lib.corpus_digest(documents))
        logging.info("%s already holds prepare's output of these arguments and this corpus: nothing to do", out_dir)
        return metadata
    train_docs, eval_docs = corpus_lib.split(documents, eval_fraction)
    tok = corpus_lib.make_tokenizer(tokenizer, train_docs, vocab_size)
    records = {"train": to_records(corpus_lib.token_stream(train_docs, tok), seq_len)}
    if eval_docs:
        records["eval"] = to_records(corpus_lib.token_stream(eval_docs, tok), seq_len)
    for split, docs in (("train", train_docs), ("eval", eval_docs)):
        if split in records and not len(records[split]):
            raise CorpusError(f"--seq_len={seq_len}: the {split} split ({len(docs)} files) has fewer than "
                              f"{seq_len + 1} tokens, not one record")
    metadata = {
        "tokenizer": tok.name, "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id), "seq_len": seq_len,
        "tokens_per_record": seq_len + 1, "dtype": "int32",
        "corpus": {"dir": os.path.abspath(corpus_dir), "files": len(documents), "skipped_not_utf8": skipped,
                   "bytes": sum(len(d.text.encode()) for d in documents),
                   "digest": corpus_lib.corpus_digest(documents)},
        "splits": {},
        "arguments": arguments,  # what a second run with the same arguments recognises (finished_output)
    }
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        for split, rows in records.items():
            docs = train_docs if split == "train" else eval_docs
            metadata["splits"][split] = {
                "glob": f"{split}-*.array_record", "records": len(rows), "source_files": len(docs),
                "shards": write_split(staging, split, rows, records_per_shard)}
        if tok.model_bytes() is not None:
            with open(os.path.join(staging, "tokenizer.model"), "wb") as f:
                f.write(tok.model_bytes())
            metadata["tokenizer_model"] = "tokenizer.model"
        with open(os.path.join(staging, METADATA), "w") as f:
            json.dump(metadata, f, indent=1, sort_keys=True)
            f.write("\n")
        os.chmod(staging, 0o755)
        os.replace(staging, out_dir)  # onto a missing or empty folder: all or nothing
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging)
    logging.info("prepared %s: %s", out_dir, {s: v["records"] for s, v in metadata["splits"].items()})
    return metadata


def finished_output(out_dir: str, arguments: dict, corpus_digest: str) -> dict:
    """The metadata of prepare's finished output in `out_dir` when it was made with `arguments` from a
    corpus of this digest and every shard it lists is there at its size; else a CorpusError naming what
    differs (exit 2, nothing changed)."""
    try:
        with open(os.path.join(out_dir, METADATA)) as f:
            metadata = json.load(f)
        recorded = metadata["arguments"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CorpusError(f"--out_dir={out_dir}: exists and is not an empty folder, nor prepare's finished "
                          "output (no readable metadata.json with its arguments)") from None
    differing = [f"--{name}={arguments[name]} (it holds {recorded.get(name)})" for name in arguments
                 if recorded.get(name) != arguments[name]]
    if differing:
        raise CorpusError(f"--out_dir={out_dir}: holds prepare's output of other arguments: {', '.join(differing)}; "
                          "choose another --out_dir")
    if metadata.get("corpus", {}).get("digest") != corpus_digest:
        raise CorpusError(f"--out_dir={out_dir}: holds prepare's output of another content of "
                          f"--corpus_dir={arguments['corpus_dir']} (its files changed); choose another --out_dir")
    for split in metadata["splits"].values():
        for shard in split["shards"]:
            path = os.path.join(out_dir, shard["name"])
            if not os.path.isfile(path) or os.path.getsize(path) != shard["size"]:
                raise CorpusError(f"--out_dir={out_dir}: prepare's output there is incomplete ({path} is missing or "
                                  "not its recorded size); choose another --out_dir")
    return metadata
