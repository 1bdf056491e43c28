"""prepare's corpus: text files of a folder in path order, split by file, and the tokenizers.

The default corpus is the Python standard library's own sources (`sysconfig.get_paths()["stdlib"]`,
*.py, without site-packages/dist-packages, whose contents differ between machines): text that
every machine has and that no one here wrote. Files are taken in sorted order of their path
relative to the folder, so the same folder and bounds give the same corpus. A file that is not
UTF-8 is skipped (and counted). Tokenizers: `bytes` (the UTF-8 bytes, 0..255, and EOS = 256 after
each file: vocabulary 257) or `sentencepiece`, trained here from the train split only; nothing is
downloaded.
"""

import dataclasses
import hashlib
import io
import os
import sysconfig

import numpy as np
from absl import logging

from trainer.input.errors import CorpusError

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
BYTES_VOCAB = 257
BYTES_EOS = 256


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # path relative to the corpus folder
    text: str


def read_corpus(corpus_dir: str, suffixes: tuple[str, ...], max_files: int | None = None,
                max_bytes: int | None = None) -> tuple[list[Document], int]:
    """(documents in path order, files skipped as not UTF-8); stops after max_files files or once
    max_bytes bytes are read (the file that crosses the bound is the last one)."""
    if not os.path.isdir(corpus_dir):
        raise CorpusError(f"--corpus_dir={corpus_dir}: not a directory")
    names = []
    for parent, dirs, files in os.walk(corpus_dir):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        names += [os.path.relpath(os.path.join(parent, f), corpus_dir) for f in files if f.endswith(suffixes)]
    documents, skipped, total = [], 0, 0
    for name in sorted(names):
        if (max_files is not None and len(documents) >= max_files) or (max_bytes is not None and total >= max_bytes):
            break
        try:
            with open(os.path.join(corpus_dir, name), "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if text:
            documents.append(Document(name, text))
            total += len(raw)
    if not documents:
        raise CorpusError(f"--corpus_dir={corpus_dir}: no UTF-8 text files ending in {', '.join(suffixes)}")
    return documents, skipped


def split(documents: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, eval) by whole files: the eval files are the round(fraction * n) (at least one) whose
    sha256 of their name is smallest, a choice that does not depend on which other files exist."""
    if not 0 <= eval_fraction < 1:
        raise CorpusError(f"--eval_fraction={eval_fraction}: must be in [0, 1)")
    if eval_fraction == 0:
        return documents, []
    if len(documents) < 2:
        raise CorpusError(f"--eval_fraction={eval_fraction}: a train/eval split needs at least 2 files, found "
                          f"{len(documents)}")
    count = min(max(1, round(eval_fraction * len(documents))), len(documents) - 1)
    ranked = sorted((hashlib.sha256(d.name.encode()).hexdigest(), d.name) for d in documents)
    held_names = {name for _, name in ranked[:count]}
    return [d for d in documents if d.name not in held_names], [d for d in documents if d.name in held_names]


def corpus_digest(documents: list[Document]) -> str:
    digest = hashlib.sha256()
    for d in documents:
        digest.update(f"{d.name}\0{hashlib.sha256(d.text.encode()).hexdigest()}\0".encode())
    return digest.hexdigest()


class BytesTokenizer:
    name, vocab_size, eos_id = "bytes", BYTES_VOCAB, BYTES_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def model_bytes(self) -> bytes | None:
        return None


class SentencePieceTokenizer:
    """A SentencePiece model trained on the train documents; whitespace and newlines are kept."""

    name = "sentencepiece"

    def __init__(self, documents: list[Document], vocab_size: int):
        import sentencepiece as spm  # only this tokenizer needs it

        model = io.BytesIO()
        lines = [line for d in documents for line in d.text.splitlines() if line.strip()]
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="unigram",
                num_threads=1, shuffle_input_sentence=False, input_sentence_size=0, character_coverage=1.0,
                byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=["\n"],
                unk_id=0, bos_id=-1, eos_id=1, pad_id=-1, minloglevel=2)
        except RuntimeError as err:
            raise CorpusError(f"--vocab_size={vocab_size}: sentencepiece training failed: "
                              f"{str(err).strip().splitlines()[-1]}") from None
        self._model = model.getvalue()
        self._processor = spm.SentencePieceProcessor(model_proto=self._model)
        self.vocab_size, self.eos_id = self._processor.get_piece_size(), self._processor.eos_id()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text), np.int32)

    def model_bytes(self) -> bytes:
        return self._model


def make_tokenizer(kind: str, train_documents: list[Document], vocab_size: int):
    if kind == "bytes":
        return BytesTokenizer()
    if kind == "sentencepiece":
        if vocab_size < 260:  # byte fallback alone takes 256 pieces, plus unk, eos and "\n"
            raise CorpusError(f"--vocab_size={vocab_size}: sentencepiece with byte fallback needs at least 260")
        logging.info("training a sentencepiece model of %d pieces on %d files", vocab_size, len(train_documents))
        return SentencePieceTokenizer(train_documents, vocab_size)
    raise CorpusError(f"--tokenizer={kind}: expected bytes or sentencepiece")


def token_stream(documents: list[Document], tokenizer) -> np.ndarray:
    """The documents' tokens in path order, each followed by EOS."""
    eos = np.asarray([tokenizer.eos_id], np.int32)
    parts = [piece for d in documents for piece in (tokenizer.encode(d.text), eos)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)
