"""A user's own loop whose input position is NOT a function of the step: a filtered Grain pipeline.

    python -m examples.stateful_input_loop --workdir=DIR [--steps=60]
    python -m verifier.verify --workdir=DIR --mesh=data=2 --once     # replays from the saved positions

The pipeline draws rows from (seed, index) in shuffled epochs and drops the ones whose target is
below a threshold, so how many rows a step consumes depends on the rows themselves: after step s
the iterator is at some index that only running the pipeline can tell. The Checkpointer saves the
iterator's state in every step (`data_iterator=`, one JSON file per process, Grain's own Orbax
handler) and a resume sets it back; a resume on another process count is refused by name (exit 2).
`replay_program` gives the verifier `batches_from(states)`, the same pipeline set to the states a
step saved, in place of a `batch_fn(step)`.
"""

from runtime import distributed  # first, and without JAX (its flags; a pod passes --num_processes)

import types  # noqa: E402

import flax.linen as nn  # noqa: E402
import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from checkpointing import CheckpointConfig, Checkpointer  # noqa: E402
from checkpointing.config import make_mesh  # noqa: E402
from runtime import entry  # noqa: E402

# What a resume must keep. About 40% of the rows are dropped, so step s reads past row s*batch.
CONFIG = {"seed": 0, "learning_rate": 3e-3, "hidden": 64, "batch": 32, "features": 16, "rows": 2048,
          "keep_above": -0.25}


def input_iterator(config: dict, process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
    """This process's batches (batch / process_count rows each): rows index::process_count of the
    shuffled epochs, the ones with a target below keep_above dropped. Grain's read threads run ahead."""

    def row(index):
        x = np.random.default_rng([config["seed"], int(index)]).normal(size=config["features"]).astype(np.float32)
        return {"x": x, "y": np.sin(x.sum(keepdims=True)).astype(np.float32)}

    rows = grain.MapDataset.range(config["rows"]).shuffle(seed=config["seed"]).repeat()
    rows = rows[process_index::process_count].map(row).filter(lambda r: r["y"][0] > config["keep_above"])
    batches = rows.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
    return iter(batches.batch(config["batch"] // process_count, drop_remainder=True))


class GlobalBatches:
    """The global batches from the positions every process of a run saved (None: a process at the
    run's start): one pipeline per saved process, their rows concatenated in process order; `input_states()` is where
    each pipeline has got to (the verifier compares it with the step it proves)."""

    def __init__(self, config: dict, states: list[dict | None], sharding: NamedSharding):
        self.iterators = [input_iterator(config, index, len(states)) for index in range(len(states))]
        for iterator, saved in zip(self.iterators, states):
            if saved is not None:  # None: that process at the run's start
                iterator.set_state(saved)
        self.sharding = sharding

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        parts = [next(iterator) for iterator in self.iterators]
        rows = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        return {name: jax.make_array_from_callback(value.shape, self.sharding, lambda index, v=value: v[index])
                for name, value in rows.items()}

    def input_states(self) -> list[dict]:
        return [iterator.get_state() for iterator in self.iterators]


def replay_program(config: dict, mesh: jax.sharding.Mesh):
    """init, a donated step, batches_from(states) and the shardings on `mesh` (verifier/program.py)."""
    model = nn.Sequential([nn.Dense(config["hidden"]), nn.gelu, nn.Dense(1)])
    tx = optax.adam(config["learning_rate"])

    def init():
        params = model.init(jax.random.key(config["seed"]), jnp.zeros((1, config["features"])))
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def train_step(state, batch):
        def loss_fn(params):
            return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}, loss

    abstract = jax.eval_shape(init)
    shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, P()), abstract)
    batch_sharding = NamedSharding(mesh, P("data"))

    def batches_from(states: list[dict | None]) -> GlobalBatches:
        return GlobalBatches(config, states, batch_sharding)

    return types.SimpleNamespace(
        mesh=mesh, state_shardings=shardings, init_fn=jax.jit(init, out_shardings=shardings),
        abstract_state=jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract, shardings),
        step_fn=jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                        out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0),
        batch_sharding=batch_sharding, batches_from=batches_from,
        # The batch axis is the only one split: a layout reorders the mean's sum (measured below 1e-6).
        loss_rtol=1e-5, state_rtol=2e-5)


def main(argv):
    del argv
    distributed.initialize()
    args = flags.FLAGS
    mesh = make_mesh()  # every device on data (checkpointing.config.make_mesh: Auto axes)
    program = replay_program(CONFIG, mesh)
    iterator = input_iterator(CONFIG, jax.process_index(), jax.process_count())
    options = CheckpointConfig(save_every_steps=args.save_every_steps, max_to_keep=100)
    with Checkpointer(args.workdir, options, config=CONFIG, fixed=CONFIG, mesh=mesh, total_steps=args.steps,
                      program="examples.stateful_input_loop:replay_program", data_iterator=iterator) as checkpointer:
        start = checkpointer.restore_or_init(program.abstract_state, program.init_fn)  # sets `iterator` too
        state = start.state
        for step in range(start.step, args.steps):
            local = next(iterator)  # the iterator has yielded exactly the batches of the steps done
            batch = {name: jax.make_array_from_process_local_data(program.batch_sharding, value)
                     for name, value in local.items()}
            state, loss = program.step_fn(state, batch)
            checkpointer.on_step(step + 1, state, loss)


if __name__ == "__main__":  # flags only here: the verifier imports this module for replay_program
    flags.DEFINE_string("workdir", None, "Where checkpoints live.", required=True)
    flags.DEFINE_integer("steps", 60, "Steps to train.")
    flags.DEFINE_integer("save_every_steps", 20, "Save cadence.")
    entry.run(main)
