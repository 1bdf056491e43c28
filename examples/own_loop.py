"""A user's own training loop, not our trainer, protected by the checkpoint service's public API.

    python -m examples.own_loop --workdir=DIR [--mesh=data=4,model=2] [--steps=100]
    python -m verifier.verify --workdir=DIR --mesh=data=2 --once     # proves every checkpoint

Its own flax model, optax chain, data and step; the Checkpointer brings the lease, the save policy,
preemption (SIGTERM or Ctrl-C: save, exit 75) and a resume on any mesh. `replay_program` is what
the verifier imports (named in every manifest) to replay this loop's steps.
"""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing import CheckpointConfig, Checkpointer, run_main
from checkpointing.config import make_mesh

CONFIG = {"seed": 0, "learning_rate": 3e-3, "hidden": 256, "batch": 64, "features": 32}  # what a resume must keep


def replay_program(config: dict, mesh: jax.sharding.Mesh):
    """init, a donated step, batch(step) and the state's shardings on `mesh`: the loop's whole program."""
    model = nn.Sequential([nn.Dense(config["hidden"]), nn.gelu, nn.Dense(1)])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(config["learning_rate"], weight_decay=1e-4))
    data_key = jax.random.fold_in(jax.random.key(config["seed"]), 1)

    def init():
        params = model.init(jax.random.key(config["seed"]), jnp.zeros((1, config["features"])))
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def batch(step):  # the rows of step s are a function of (seed, s): any mesh, any restart
        x = jax.random.normal(jax.random.fold_in(data_key, step), (config["batch"], config["features"]))
        return x, jnp.sin(x.sum(axis=1, keepdims=True))

    def train_step(state, batch):
        def loss_fn(params):
            return jnp.mean((model.apply(params, batch[0]) - batch[1]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}, loss

    abstract = jax.eval_shape(init)
    shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, P(None, "model") if leaf.ndim == 2 and
                                                        leaf.shape[1] % mesh.shape["model"] == 0 else P()), abstract)
    batch_sharding = NamedSharding(mesh, P("data"))
    return types.SimpleNamespace(
        mesh=mesh, state_shardings=shardings, init_fn=jax.jit(init, out_shardings=shardings),
        abstract_state=jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract, shardings),
        step_fn=jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                        out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0),
        batch_fn=jax.jit(batch, out_shardings=batch_sharding),
        # Measured: losses within 3.0e-7 over 100 steps on data=8, data=4,model=2, data=2,model=4 and one device.
        loss_rtol=1e-5, state_rtol=2e-5)


def main(argv):
    args = flags.FLAGS
    mesh = make_mesh(args.mesh)
    program = replay_program(CONFIG, mesh)
    options = CheckpointConfig(save_every_steps=args.save_every_steps, max_to_keep=100)
    with Checkpointer(args.workdir, options, config=CONFIG, fixed=CONFIG, mesh=mesh, total_steps=args.steps,
                      program="examples.own_loop:replay_program") as checkpointer:
        start = checkpointer.restore_or_init(program.abstract_state, program.init_fn)
        state = start.state
        for step in range(start.step, args.steps):
            state, loss = program.step_fn(state, program.batch_fn(step))
            checkpointer.on_step(step + 1, state, loss)


if __name__ == "__main__":  # flags only here: the verifier imports this module for replay_program
    flags.DEFINE_string("workdir", None, "Where checkpoints live.", required=True)
    flags.DEFINE_string("mesh", "", "data=N,model=M (default: data=<all devices>).")
    flags.DEFINE_integer("steps", 100, "Steps to train.")
    flags.DEFINE_integer("save_every_steps", 20, "Save cadence.")
    run_main(main)  # the trainer's exit codes and one-line errors (a held lease: exit 2), quiet Orbax logs
