"""Evaluation over a fixed set of held-out batches, and the throughput of the loop's steps.

`Evaluator`: every --eval_every_steps, the mean loss of the model over --eval_batches batches of
--eval_data: steps 0..k-1 of the eval split in its own fixed order (trainer/input/order.py), read
once at start-up and kept on the devices. The same params on the same layout give the same bits,
so a resumed run's eval numbers equal the uninterrupted run's. For a token model (a batch of
{"tokens"}: next-token cross-entropy) the perplexity exp(loss) is reported beside it.

`Throughput`: examples/s (and tokens/s for a token model) and the time the steps waited for input
rows that the read-ahead did not have yet (trainer/input/pipeline.py's last_wait_secs).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def tokens_per_example(abstract_batch) -> int | None:
    """Predicted tokens per example of a {"tokens": (B, L + 1)} batch; None for another model's."""
    if isinstance(abstract_batch, dict) and "tokens" in abstract_batch and len(abstract_batch) == 1:
        return abstract_batch["tokens"].shape[1] - 1
    return None


class Evaluator:
    """program -> {"eval_loss", "eval_perplexity"} at the eval cadence (every process: a collective)."""

    def __init__(self, program):
        config = program.config
        self.every_steps = config.eval_every_steps
        source = program.inputs.eval_batches  # trainer/config.py validate: --eval_data given, a plain loss
        with jax.transfer_guard_host_to_device("allow"):  # read once; the loop itself sends only steps
            self.batches = tuple(source(step) for step in range(config.eval_batches))
        source.close()
        self.is_lm = tokens_per_example(program.abstract_batch) is not None
        loss_fn = program.loss_fn

        def mean_loss(params, batches):
            return jnp.mean(jnp.stack([loss_fn(params, batch) for batch in batches]))

        self._mean_loss = jax.jit(mean_loss, out_shardings=NamedSharding(program.mesh, P()))

    def evaluate(self, params) -> dict[str, float]:
        loss = float(jax.device_get(self._mean_loss(params, self.batches)))
        values = {"eval_loss": loss}
        if self.is_lm:
            values["eval_perplexity"] = math.exp(min(loss, 700.0)) if loss == loss else loss
        return values

    def maybe_evaluate(self, done: int, params) -> dict[str, float] | None:
        """The eval numbers after `done` steps when the cadence says so, else None."""
        if not self.every_steps or done % self.every_steps:
            return None
        return self.evaluate(params)


class Throughput:
    """Examples/s, tokens/s and the input wait per step over one log interval."""

    def __init__(self, program):
        self._batch_fn = program.batch_fn
        self.examples_per_step = program.config.batch_size
        self.tokens_per_example = tokens_per_example(program.abstract_batch)
        self._wait_secs, self._max_wait_secs = 0.0, 0.0

    def add_wait(self) -> None:
        """After each batch call: how long it waited for rows (0 for a synthetic draw)."""
        wait = float(getattr(self._batch_fn, "last_wait_secs", 0.0))
        self._wait_secs += wait
        self._max_wait_secs = max(self._max_wait_secs, wait)

    def report(self, steps: int, secs: float) -> dict[str, float]:
        """The interval's numbers; starts the next interval."""
        examples = self.examples_per_step * steps / max(secs, 1e-9)
        values = {"examples_per_sec": examples, "input_wait_secs": self._wait_secs / max(steps, 1),
                  "input_wait_max_secs": self._max_wait_secs}
        if self.tokens_per_example is not None:
            values["tokens_per_sec"] = examples * self.tokens_per_example
        self._wait_secs, self._max_wait_secs = 0.0, 0.0
        return values
