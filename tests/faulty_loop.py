"""A training loop that goes wrong on purpose, for the verifier's broken and silently corrupted runs
(tests/test_verdict_matrix.py, benchmarks/verdict_matrix.py).

It is the trainer's program (trainer/program.py) driven by the public Checkpointer, opened as the trainer
opens it (trainer.loop.open_checkpointer: the same identity, program and probes), so with no fault its
checkpoints are the trainer's bit for bit. A fault breaks what a buggy resume or a flaky device would:

  restarted_step_index     after a resume, batches drawn from step 0 again (the loop's index restarted)
  restarted_loop_counter   after a resume, the state's step counter set back to 0
  zeroed_moments           after a resume, both Adam moments zeroed (a restore that lost them)
  other_learning_rate      after a resume, steps taken with the learning rate times `size`
  skipped_batch            after a resume, the resumed step's batch skipped (every later one a step ahead)
  repeated_batch           after a resume, the last batch before it drawn again (every later one a step behind)
  corrupt                  one step's output changed: element `index` of leaf `leaf` times (1 + size), at
                           step `at_step` (a wrong value between two saves; each save is of the state it holds)
  corrupt_input            one step's input changed: element `index` of the batch's first float leaf times
                           (1 + size), for the step that makes counter `at_step` and, with `every`, each
                           `every` steps after it (a flaky host's read: the state carries it on, consistently)

Every save is consistent with the state the loop held: its fingerprints, losses and probes are the loop's own.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.tamper import KERNEL, zero_adam_moments
from trainer import loop, model_config
from trainer.config import TrainConfig
from trainer.program import build_mesh, build_program

RESUME_FAULTS = ("restarted_step_index", "restarted_loop_counter", "zeroed_moments", "other_learning_rate",
                 "skipped_batch", "repeated_batch")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str = "none"  # "none", "corrupt" or one of RESUME_FAULTS
    size: float = 0.0  # corrupt: the relative change; other_learning_rate: the factor
    at_step: int = 0  # corrupt: the step counter of the state changed
    leaf: str = KERNEL  # corrupt: the leaf changed
    index: tuple[int, ...] = (3, 7)  # corrupt, corrupt_input: its element
    every: int = 0  # corrupt_input: the step corrupted again every this many steps (0: once)


def input_corrupted_at(fault: Fault, counter: int) -> bool:
    """Whether the batch of the step that makes state counter `counter` is corrupted."""
    if fault.kind != "corrupt_input" or counter < fault.at_step:
        return False
    return counter == fault.at_step or (fault.every > 0 and (counter - fault.at_step) % fault.every == 0)


def batch_step(fault: Fault, step: int, resumed_at: int) -> int:
    """The batch the faulty loop draws for `step` after a resume at `resumed_at`."""
    if not resumed_at:
        return step
    return {"restarted_step_index": step - resumed_at, "skipped_batch": step + 1,
            "repeated_batch": step - 1}.get(fault.kind, step)


def on_resume(fault: Fault, state):
    """The state a broken resume starts from."""
    if fault.kind == "zeroed_moments":
        return zero_adam_moments(state)
    if fault.kind == "restarted_loop_counter":
        return state.replace(step=jax.device_put(jnp.zeros_like(state.step), state.step.sharding))
    return state


def corrupted(fault: Fault, state):
    """`state` with one element changed by the relative amount fault.size."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = []
    for path, leaf in flat:
        if jax.tree_util.keystr(path) == fault.leaf:
            host = np.array(leaf)
            host[fault.index] = host[fault.index] * np.float32(1 + fault.size)
            leaf = jax.device_put(host, leaf.sharding)
        leaves.append(leaf)
    return jax.tree.unflatten(treedef, leaves)


def corrupted_batch(fault: Fault, batch):
    """`batch` with one element of its first float leaf times (1 + fault.size): the step's input, on its
    shardings, as a host that read one value wrong would have fed it."""
    flat, treedef = jax.tree_util.tree_flatten(batch)
    leaves, done = [], False
    for leaf in flat:
        if not done and jnp.issubdtype(leaf.dtype, jnp.floating):
            host = np.array(leaf)
            index = tuple(min(i, n - 1) for i, n in zip(fault.index, host.shape))
            host[index] = host[index] * host.dtype.type(1 + fault.size)
            leaf, done = jax.device_put(host, leaf.sharding), True
        leaves.append(leaf)
    if not done:
        raise ValueError("corrupt_input: the batch has no float leaf (token inputs: corrupt a leaf of the state)")
    return jax.tree.unflatten(treedef, leaves)


def tree_like(tree, like):
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))


def train(config: TrainConfig, fault: Fault = Fault()) -> None:
    """Trains (or resumes) `config`'s run up to config.steps as the trainer would, with `fault`."""
    mesh = build_mesh(config)
    with loop.matmul_precision(config.matmul_precision), loop.open_checkpointer(config, mesh) as checkpointer:
        program = build_program(config, mesh)
        stepping = program
        start = checkpointer.restore_or_init(program.abstract_state, program.init_fn)
        state = start.state
        if start.step:
            state = on_resume(fault, state)
            if fault.kind == "other_learning_rate":
                other = model_config.replace(config, learning_rate=config.learning_rate * fault.size)
                stepping = build_program(other, mesh)
        for step in range(start.step, config.steps):
            # Another program's state carries its own optimizer as static tree data: same leaves, its tree.
            batch = stepping.batch_fn(batch_step(fault, step, start.step))
            if input_corrupted_at(fault, step + 1):
                batch = corrupted_batch(fault, batch)
            stepped, loss = stepping.step_fn(tree_like(state, stepping.abstract_state), batch)
            state = tree_like(stepped, program.abstract_state)
            if fault.kind == "corrupt" and step + 1 == fault.at_step:
                state = corrupted(fault, state)
            checkpointer.on_step(step + 1, state, loss)
