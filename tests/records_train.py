"""Shared flags of the tests that train the transformer on a real corpus (conftest.stdlib_corpus)."""

import os


def lm_flags(corpus: str, *, eval_every_steps: int = 8) -> list[str]:
    """The transformer as a causal LM on the corpus's bytes, with the eval split every few steps."""
    return ["--model=transformer", "--seq_len=32", "--hidden_dim=32", "--vocab_size=257", "--batch_size=32",
            f"--data=records:{os.path.join(corpus, 'train-*.array_record')}",
            f"--eval_data=records:{os.path.join(corpus, 'eval-*.array_record')}",
            f"--eval_every_steps={eval_every_steps}", "--eval_batches=2"]


def eval_losses(workdir: str) -> dict[int, float]:
    """{step: eval_loss} from every committed manifest's extra.metrics."""
    from checkpointing._src.workdir import committed_steps, read_manifest

    found = {}
    for step in committed_steps(workdir):
        for at, values in read_manifest(workdir, step).get("extra", {}).get("metrics", {}).items():
            found[int(at)] = values["eval_loss"]
    return dict(sorted(found.items()))
