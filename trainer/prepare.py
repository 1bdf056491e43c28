"""Entry point: python -m trainer.prepare --out_dir=OUT --seq_len=N [--corpus_dir=DIR] [--tokenizer=bytes]

Turns a folder of text files (default: the Python standard library's sources) into ArrayRecord
shards of seq_len + 1 int32 tokens with a train/eval split and metadata.json; the trainer reads
them with --data=records:OUT/train-*.array_record (docs/data.md). Kept short on purpose:
trainer/input/shards.py's prepare() does the work (tests call it). Exit 0 done, or --out_dir already
held prepare's output of the same arguments and corpus (so `prepare && train` runs again); 2 bad input,
other arguments' output included: one `error:` line and nothing written.
"""

from absl import flags

from runtime import entry
from trainer.input import corpus, shards

CORPUS_DIR = flags.DEFINE_string("corpus_dir", None, "Folder of text files; default: the Python stdlib's sources.")
OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the shards go: a folder that does not exist or is empty; one "
                               "that holds prepare's output of the same arguments is kept as it is (exit 0).")
SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per example (each record holds seq_len + 1).")
TOKENIZER = flags.DEFINE_enum("tokenizer", "bytes", ["bytes", "sentencepiece"], "bytes (vocab 257) or a "
                              "sentencepiece model trained here on the train split.")
VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 1024, "sentencepiece: pieces in the vocabulary.")
EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.05, "Share of the files held out as the eval split.")
SUFFIXES = flags.DEFINE_list("suffixes", [".py"], "File name endings that count as text.")
MAX_FILES = flags.DEFINE_integer("max_files", None, "Read at most this many files (in path order).")
MAX_BYTES = flags.DEFINE_integer("max_bytes", None, "Stop reading files once this many bytes are read.")
RECORDS_PER_SHARD = flags.DEFINE_integer("records_per_shard", 4096, "Records per ArrayRecord file.")


def main(argv: list[str]) -> None:
    if OUT_DIR.value is None or SEQ_LEN.value is None:
        raise ValueError("--out_dir and --seq_len are required")
    shards.prepare(CORPUS_DIR.value or corpus.default_corpus_dir(), OUT_DIR.value, SEQ_LEN.value,
                   tokenizer=TOKENIZER.value, vocab_size=VOCAB_SIZE.value, eval_fraction=EVAL_FRACTION.value,
                   suffixes=tuple(SUFFIXES.value), max_files=MAX_FILES.value, max_bytes=MAX_BYTES.value,
                   records_per_shard=RECORDS_PER_SHARD.value)


if __name__ == "__main__":
    entry.run(main)
