"""Deterministic synthetic data: the global batch of step s is a pure function of (seed, s).

The batch key is fold_in(data_key, s), and the model's spec draws the batch from that key alone
(trainer/models), so a resume needs only the step number to draw the same rows. Batches are
produced by a jitted function whose output sharding splits the batch axis over 'data': each
device computes only its own rows (JAX's partitionable threefry makes the drawn values
independent of how the array is split), so no host ever holds, or gathers, the global batch,
and every mesh sees the same numbers.

`--data=records:<glob>` replaces them with the rows of prepared record files (trainer/input:
the position is still the step); `open_inputs` opens them, and the eval split, at start-up, and
`Inputs.recorded()` is the dataset identity every manifest records.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainer.config import ConfigError, TrainConfig
from trainer.models import ModelSpec


def data_key(config: TrainConfig) -> jax.Array:
    """The key every batch is folded from; a constant of the program, never state."""
    return jax.random.fold_in(jax.random.key(config.seed), 1)


def step_rng(config: TrainConfig, step: jax.Array) -> jax.Array:
    """The loss's rng of `step` (dropout): fold_in(fold_in(key(seed), 2), step), like the batch key;
    stateless, so every mesh and every restart draws the same masks."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), 2), step)


def synthetic_batch(spec: ModelSpec, config: TrainConfig, step: jax.Array) -> dict[str, jax.Array]:
    """The global batch of `step`: same values on every mesh and every restart."""
    return spec.synthetic_batch(config, jax.random.fold_in(data_key(config), step))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch axis over 'data'; everything else (and the 'model' axis) replicated."""
    return NamedSharding(mesh, P("data"))


def make_batch_fn(spec: ModelSpec, config: TrainConfig, mesh: Mesh):
    """step -> global batch array, each device computing only its shard."""
    return jax.jit(functools.partial(synthetic_batch, spec, config), out_shardings=batch_sharding(mesh))


# --- record files: --data=records:<glob> (trainer/input, docs/data.md) -------------------------------

SYNTHETIC = "synthetic"
# Keys the trainer adds to the config it hands the Checkpointer when the data is records: each split's
# identity (recorded in every manifest) and its digest (a field a resume must not change; the eval
# split's, with --eval_batches, only when there is one, so a run without one keeps its fixed hash).
IDENTITY_KEY, EVAL_IDENTITY_KEY, DIGEST_KEY = "data_identity", "eval_data_identity", "data_digest"
EVAL_DIGEST_KEY = "eval_data_digest"
RECORDED_KEYS = (IDENTITY_KEY, EVAL_IDENTITY_KEY, DIGEST_KEY, EVAL_DIGEST_KEY)
CHECK_DATA = ("stat", "full")  # trainer/input/digests.py's CHECKS, here so a synthetic run imports no Grain
ACCEPT_HINT = "; to train on the changed files anyway, resume with --accept_data_change (the manifests record it)"


@dataclasses.dataclass
class Inputs:
    """What --data and --eval_data name, opened and checked at start-up (before anything is written)."""

    batches: Any = None  # a trainer.input.RecordBatches for --data=records:..., None: synthetic
    eval_batches: Any = None  # the same over --eval_data, or None
    # Set by a resume's check (check_resumed): the run's fixed digests, kept from its newest manifest (they
    # differ from the files' own digests after an accepted change, or for a run begun before content
    # digests), and each split's accepted change, recorded in its identity.
    carried: dict = dataclasses.field(default_factory=dict)
    accepted: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)  # (level, line): logged once the run is admitted

    def identity(self, key: str) -> dict | None:
        """The identity of the split `key` names (IDENTITY_KEY or EVAL_IDENTITY_KEY), None if there is none."""
        batches = self.batches if key == IDENTITY_KEY else self.eval_batches
        if batches is None:
            return None
        identity = batches.dataset.identity()
        return {**identity, "accepted_change": self.accepted[key]} if key in self.accepted else identity

    def recorded(self) -> dict:
        """The config entries every manifest records ({} for synthetic data)."""
        if self.batches is None:
            return {}
        identity = self.identity(IDENTITY_KEY)
        recorded = {IDENTITY_KEY: identity, DIGEST_KEY: self.carried.get(DIGEST_KEY, identity["digest"]),
                    EVAL_IDENTITY_KEY: None}
        if self.eval_batches is not None:
            eval_identity = self.identity(EVAL_IDENTITY_KEY)
            recorded.update({EVAL_IDENTITY_KEY: eval_identity,
                             EVAL_DIGEST_KEY: self.carried.get(EVAL_DIGEST_KEY, eval_identity["digest"])})
        return recorded

    def fixed_names(self) -> tuple[str, ...]:
        """The recorded keys (and flags) a resume must not change: the digests of the splits, and with an
        eval split --eval_batches, so that every eval loss of a run is measured on the same rows."""
        recorded = self.recorded()
        return ((DIGEST_KEY,) if recorded else ()) + ((EVAL_DIGEST_KEY, "eval_batches")
                                                      if recorded.get(EVAL_DIGEST_KEY) else ())

    def log_admitted(self) -> None:
        """Where each split's content digests came from (every process hashes its own), and what a
        resume's check noted: logged once the run is admitted, so a refused run prints one line."""
        for label, batches in (("--data", self.batches), ("--eval_data", self.eval_batches)):
            if batches is not None:
                tally, files = batches.dataset.digest_tally, len(batches.dataset.files)
                logging.info("%s content (sha256) of %d files: %s (process %d)", label, files, tally.describe(),
                             jax.process_index())
                for note in tally.notes:
                    logging.warning("%s: %s", label, note)
        if jax.process_index() == 0:
            for level, line in self.notes:
                logging.log(level, "%s", line)

    def close(self) -> None:
        for batches in (self.batches, self.eval_batches):
            if batches is not None:
                batches.close()


def open_inputs(spec: ModelSpec, config: TrainConfig, mesh: Mesh) -> Inputs:
    """Opens the record files the config names; a DataError (one line, exit 2) names a bad flag or file."""
    if config.check_data not in CHECK_DATA:
        raise ConfigError(f"--check_data={config.check_data}: expected {' or '.join(CHECK_DATA)}")
    if config.data == SYNTHETIC and not (config.eval_data or config.eval_every_steps):
        return Inputs()  # nothing to open, nor to import: Grain's import costs a restart 0.1-0.2 s
    from trainer import input as data_input  # here, not above: it imports Grain (see the return above)

    if config.data != SYNTHETIC and not config.data.startswith(data_input.records.PREFIX):
        raise data_input.DataError(f"--data={config.data}: expected synthetic or records:<glob>")
    if config.eval_every_steps and not config.eval_data:
        raise data_input.DataError(f"--eval_every_steps={config.eval_every_steps} needs --eval_data=records:<glob>")
    if config.eval_data and config.data == SYNTHETIC:
        raise data_input.DataError(f"--eval_data={config.eval_data} needs --data=records:<glob> (the train split)")
    inputs = Inputs()
    for name in ("data", "eval_data"):
        value = getattr(config, name)
        if value and value != SYNTHETIC:
            batches = data_input.record_batches(value, config.seed, config.batch_size, batch_sharding(mesh),
                                                seq_len=config.seq_len, vocab_size=config.vocab_size,
                                                check_data=config.check_data)
            setattr(inputs, "batches" if name == "data" else "eval_batches", batches)
            _check_model_reads(spec, config, batches, value)
    return inputs


def _check_model_reads(spec: ModelSpec, config: TrainConfig, batches, value: str) -> None:
    """The model decides how a batch is used: its own batches must have the records' structure."""
    from trainer.input import DataError  # Grain's import: only where record files are opened

    own = jax.eval_shape(lambda: spec.synthetic_batch(config, jax.random.key(0)))
    want = {"tokens": jax.ShapeDtypeStruct(batches.global_shape, jnp.int32)}
    if jax.tree.map(lambda s: (s.shape, s.dtype), own) != jax.tree.map(lambda s: (s.shape, s.dtype), want):
        described = {k: f"{v.dtype}{list(v.shape)}" for k, v in own.items()} if isinstance(own, dict) else own
        raise DataError(f"--model={config.model} reads batches {described}, not the tokens "
                        f"int32{list(batches.global_shape)} of --data={value} (a token model such as transformer)")


def abstract_batch(batch_fn, sharding: NamedSharding):
    """The global batch of a batch function as ShapeDtypeStructs with the batch sharding."""
    shapes = batch_fn.abstract() if hasattr(batch_fn, "abstract") else jax.eval_shape(batch_fn, 0)
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), shapes)


def check_recorded(recorded: dict, inputs: Inputs, where: str) -> None:
    """Refuses (DatasetChangedError naming the field or file) data other than a manifest's config recorded."""
    before, now = recorded.get(IDENTITY_KEY), inputs.identity(IDENTITY_KEY)
    _check_kind(f"data ({where})", before, now, absent=SYNTHETIC)
    if before is not None:
        _check_split(before, now, "")


def check_resumed(recorded: dict, inputs: Inputs, config: TrainConfig, step: int) -> None:
    """A resume's files against the `recorded` config of the newest manifest (`step`'s): DatasetChangedError
    (one line, exit 2) names the first field or file that differs, unless --accept_data_change accepts a
    change of a split's files, which `inputs` then records in that split's identity. Records against
    synthetic data, an eval split against none, and --eval_batches change fixed fields: never accepted.
    `inputs` keeps the run's fixed digests (the newest manifest's)."""
    where = f"step {step}"
    _check_kind(f"data ({where})", recorded.get(IDENTITY_KEY), inputs.identity(IDENTITY_KEY), absent=SYNTHETIC)
    _check_kind(f"--eval_data ({where})", recorded.get(EVAL_IDENTITY_KEY), inputs.identity(EVAL_IDENTITY_KEY),
                absent="none")
    if recorded.get(EVAL_IDENTITY_KEY) is not None and recorded.get("eval_batches") != config.eval_batches:
        from trainer.input import DatasetChangedError  # Grain's import: only on record files

        raise DatasetChangedError(f"--eval_batches ({where})", recorded.get("eval_batches"), config.eval_batches)
    for key, digest_key, label in ((IDENTITY_KEY, DIGEST_KEY, ""), (EVAL_IDENTITY_KEY, EVAL_DIGEST_KEY, "--eval_data")):
        before = recorded.get(key)
        if before is None:
            continue
        # Grain's import (0.5 s of a TPU v5e's restart): only on record files, never on a synthetic run's resume.
        from trainer.input import DatasetChangedError, has_content
        try:
            _check_split(before, inputs.identity(key), label)
        except DatasetChangedError as err:
            if not config.accept_data_change:
                raise err.derived(hint=ACCEPT_HINT) from None
            inputs.accepted[key] = {"step": step, "digest": before["digest"], "change": err.what}
            inputs.notes.append((logging.WARNING, f"--accept_data_change: {err.what} since step {step}; training "
                                                  f"on it, recorded as {key}.accepted_change in this attempt's "
                                                  "manifests"))
        if not has_content(before):
            inputs.notes.append((logging.INFO, f"{label or '--data'}: step {step}'s manifest names the files by "
                                               "name, size, record count and edge records only (it predates "
                                               "content digests); from now on every manifest records each file's "
                                               "sha256"))
        inputs.carried[digest_key] = recorded.get(digest_key, before["digest"])


def _check_kind(field: str, before: dict | None, now: dict | None, *, absent: str) -> None:
    if (before is None) != (now is None):
        from trainer.input import DatasetChangedError  # Grain's import: only when refusing

        raise DatasetChangedError(field, "records" if before else absent, "records" if now else absent)


def _check_split(before: dict, now: dict, label: str) -> None:
    from trainer.input import DatasetChangedError, check_same  # Grain's import: only on record files

    try:
        check_same(before, now)
    except DatasetChangedError as err:
        raise (err.derived(label=label) if label else err) from None
