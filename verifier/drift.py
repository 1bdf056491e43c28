"""How far a model's genuine steps drift across layouts, and how loud seed 003's broken resumes are,
both measured as the verifier's state rule sees them (verifier/tolerances.py).

A reference run trains `start_step` steps on the first mesh; its state there is the anchor. From it,
windows of k steps are replayed on the first mesh (what the trainer recorded) and on each other mesh
(what a verifier there replays), and three broken resumes run on the first mesh as a trainer would
have recorded them: the step index restarted at 0 (the state restored, batches and counter from 0),
both Adam moments zeroed, and the first moment's sign flipped. Per window and other mesh:

- loss: the largest relative difference between the two loss lists;
- state, per float leaf: ||replayed - recorded|| / max(||replayed||, ||replayed - anchor||), the
  quantity `cross_mesh_state_rtol` bounds. The largest over signal leaves, and separately over
  noise-driven leaves (their Adam first moment at most `noise_ratio` of the largest), whose ratio
  to their movement alone, ||replayed - recorded|| / ||replayed - anchor||, is what the noise factor bounds.

The same genuine windows are also replayed from the config's init (a full proof's first interval,
where Adam's first update, g/|g|, turns a gradient's rounding noise into a full-size step); that
drift gets a tolerance of its own (`derive`), so it does not loosen every later interval's.

A broken resume's signal is the same two numbers against the genuine replay on the other mesh,
over signal leaves only (conservative: noise leaves get an allowance of their own). Integer leaves
(the step counter) are compared exactly by the verifier and are not part of these ratios.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from checkpointing.verification import leaf_differences, relative_difference
from runtime.dispatch import blocks_each_step
from trainer import model_config
from trainer.config import TrainConfig
from trainer.program import build_mesh, build_program
from verifier import tolerances

BROKEN = ("restarted_step_index", "zeroed_moments", "flipped_first_moment")
_MOMENT = re.compile(r"\.(mu|nu)\[")
_FIRST_MOMENT = re.compile(r"\.mu\[")


@dataclasses.dataclass(frozen=True)
class Worst:
    """The largest ratio over a set of leaves and the leaf that has it ('' when the set is empty)."""

    ratio: float
    path: str = ""
    rms_ratio: float | None = None  # its Adam first moment's RMS over the largest one (None: no moment)


@dataclasses.dataclass(frozen=True)
class WindowDrift:
    """One window of `steps` steps replayed on `mesh` (against the first mesh's recording)."""

    mesh: str
    steps: int
    loss: float  # genuine: largest relative loss difference over the window
    signal: Worst  # genuine, signal leaves: ||d|| / max(||replayed||, moved)
    noise: Worst  # genuine, noise leaves: ||d|| / moved
    broken_loss: dict[str, float]  # kind -> largest relative loss difference
    broken_state: dict[str, Worst]  # kind -> largest signal-leaf ratio
    # genuine, the same window replayed from the config's init (a full proof's first interval)
    init_loss: float = 0.0
    init_signal: Worst = Worst(0.0)

    def smallest_signal(self) -> tuple[float, float]:
        """(smallest broken loss signal, smallest broken state signal) over the kinds."""
        return min(self.broken_loss.values()), min(w.ratio for w in self.broken_state.values())

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def mesh_label(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh)


def to_program(program, host_state):
    """`host_state` (host arrays of the same tree) placed on `program`'s state shardings."""
    treedef = jax.tree.structure(program.abstract_state)
    shardings = jax.tree.leaves(program.state_shardings)
    return jax.tree.unflatten(treedef, [jax.device_put(leaf, sharding)
                                        for leaf, sharding in zip(jax.tree.leaves(host_state), shardings)])


def trajectory(program, host_state, first_batch: int, windows: list[int]):
    """Runs max(windows) steps from `host_state`, feeding the batches of `first_batch`, ...; returns
    ({k: host state after k steps}, [loss of each step])."""
    state = to_program(program, host_state)
    snapshots, losses = {}, []
    for i in range(max(windows)):
        state, loss = program.step_fn(state, program.batch_fn(first_batch + i))
        losses.append(loss)
        if blocks_each_step(program.mesh):
            loss.block_until_ready()
        if i + 1 in windows:
            snapshots[i + 1] = jax.device_get(state)
    return snapshots, [float(v) for v in jax.device_get(losses)]


def _map_moments(host_state, pattern, fn):
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: fn(leaf) if pattern.search(jax.tree_util.keystr(path)) else leaf, host_state)


def broken_starts(host_state) -> dict[str, tuple[object, int | None]]:
    """kind -> (the state a broken resume starts from, its first batch; None: the anchor's step)."""
    restarted = host_state.replace(step=jnp.zeros_like(host_state.step))
    return {
        "restarted_step_index": (restarted, 0),
        "zeroed_moments": (_map_moments(host_state, _MOMENT, jnp.zeros_like), None),
        "flipped_first_moment": (_map_moments(host_state, _FIRST_MOMENT, lambda leaf: -leaf), None),
    }


def leaf_table(abstract_state) -> dict[str, dict]:
    """{key path: {shape, dtype}}: a manifest's leaf table, for the state rule."""
    return {jax.tree_util.keystr(p): {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}


def state_ratios(replayed, recorded, anchor, leaves, noise_ratio: float) -> tuple[Worst, Worst]:
    """(worst signal-leaf ratio, worst noise-leaf ratio) of `recorded` against `replayed`."""
    treedef = jax.tree.structure(anchor)  # each program's tree carries its own (static) optimizer
    replayed, recorded = (jax.tree.unflatten(treedef, jax.tree.leaves(t)) for t in (replayed, recorded))
    movement = leaf_differences(anchor, replayed)
    differences = leaf_differences(recorded, replayed)
    noise = tolerances.noise_leaves(movement, leaves, noise_ratio)
    rms = tolerances.moment_rms(movement, leaves)
    largest = max(rms.values(), default=0.0) or 1.0
    signal_worst, noise_worst = Worst(0.0), Worst(0.0)
    for path, (moved, norm, _) in movement.items():
        if not tolerances.is_float(leaves[path]["dtype"]):
            continue
        difference, _, finite = differences[path]
        if path in noise:
            ratio = difference / moved if moved > 0 else (0.0 if difference == 0 else math.inf)
            if not finite or not ratio <= noise_worst.ratio:
                noise_worst = Worst(math.inf if not finite else ratio, path, _rms_ratio(path, rms, largest))
        else:
            ratio = difference / max(norm, moved, 1e-30)
            if not finite or not ratio <= signal_worst.ratio:
                signal_worst = Worst(math.inf if not finite else ratio, path, _rms_ratio(path, rms, largest))
    return signal_worst, noise_worst


def _rms_ratio(path: str, rms: dict[str, float], largest: float) -> float | None:
    match = tolerances.PARAM_LEAF.match(path)
    return rms[match.group(1)] / largest if match and match.group(1) in rms else None


def loss_drift(actual: list[float], expected: list[float]) -> float:
    return max((relative_difference(a, e) for a, e in zip(actual, expected)), default=0.0)


def program_on(config: TrainConfig, mesh: tuple):
    """`config`'s program on `mesh`, over the first devices it needs (a 2-device mesh beside an 8-device one)."""
    config = model_config.replace(config, mesh=mesh)
    return build_program(config, build_mesh(config, jax.devices()[:math.prod(size for _, size in mesh)]))


def measure(config: TrainConfig, meshes: list[tuple], windows: list[int], start_step: int,
            noise_ratio: float = tolerances.NOISE_RATIO) -> list[WindowDrift]:
    """The drift of every window on every mesh after the first, against the first (module docstring)."""
    windows = sorted(set(windows))
    reference = program_on(config, meshes[0])
    leaves = leaf_table(reference.abstract_state)
    init = jax.device_get(reference.init_fn())
    init_recorded, init_recorded_losses = trajectory(reference, init, 0, windows)
    state = to_program(reference, init)
    for step in range(start_step):
        state, loss = reference.step_fn(state, reference.batch_fn(step))
        if blocks_each_step(reference.mesh):
            loss.block_until_ready()
    anchor = jax.device_get(state)
    recorded, recorded_losses = trajectory(reference, anchor, start_step, windows)
    broken = {kind: trajectory(reference, start, start_step if first is None else first, windows)
              for kind, (start, first) in broken_starts(anchor).items()}
    found = []
    for mesh in meshes[1:]:
        program = program_on(config, mesh)
        replayed, replayed_losses = trajectory(program, anchor, start_step, windows)
        init_replayed, init_replayed_losses = trajectory(program, init, 0, windows)
        for k in windows:
            signal, noise = state_ratios(replayed[k], recorded[k], anchor, leaves, noise_ratio)
            found.append(WindowDrift(
                mesh=mesh_label(mesh), steps=k, loss=loss_drift(recorded_losses[:k], replayed_losses[:k]),
                signal=signal, noise=noise,
                broken_loss={kind: loss_drift(losses[:k], replayed_losses[:k]) for kind, (_, losses) in broken.items()},
                broken_state={kind: state_ratios(replayed[k], snapshots[k], anchor, leaves, noise_ratio)[0]
                              for kind, (snapshots, _) in broken.items()},
                init_loss=loss_drift(init_recorded_losses[:k], init_replayed_losses[:k]),
                init_signal=state_ratios(init_replayed[k], init_recorded[k], init, leaves, noise_ratio)[0]))
    return found


def per_window(drifts: list[WindowDrift]) -> list[dict]:
    """Per window, over the other meshes: the largest genuine drift and the smallest broken signal."""
    rows = []
    for k in sorted({d.steps for d in drifts}):
        these = [d for d in drifts if d.steps == k]
        signal = max((d.signal for d in these), key=lambda w: w.ratio)
        noise = max((d.noise for d in these), key=lambda w: w.ratio)
        loss_signal = {kind: min(d.broken_loss[kind] for d in these) for kind in BROKEN}
        state_signal = {kind: min(d.broken_state[kind].ratio for d in these) for kind in BROKEN}
        loss = max(d.loss for d in these)
        init_signal = max((d.init_signal for d in these), key=lambda w: w.ratio)
        rows.append({"steps": k, "loss_drift": loss, "state_drift": signal.ratio, "state_drift_leaf": signal.path,
                     "state_drift_leaf_rms_ratio": signal.rms_ratio, "noise_drift": noise.ratio,
                     "noise_drift_leaf": noise.path, "loss_signal": loss_signal, "state_signal": state_signal,
                     "loss_margin": _ratio(min(loss_signal.values()), loss),
                     "state_margin": _ratio(min(state_signal.values()), signal.ratio),
                     "init_loss_drift": max(d.init_loss for d in these), "init_state_drift": init_signal.ratio,
                     "init_state_drift_leaf": init_signal.path})
    return rows


def _ratio(signal: float, drift: float) -> float:
    return math.inf if drift == 0 else signal / drift


def derive(rows: list[dict], safety: float, signal_margin: float, noise_ratio: float,
           default_noise_factor: float = tolerances.NOISE_FACTOR) -> dict:
    """The tolerances a spec should carry: the largest drift over the windows times `safety`, which must
    stay at most 1/`signal_margin` of the smallest broken state signal of every window (else the model
    cannot be proved across layouts). The loss bound is reported against the loss signals of windows
    of 2 steps or more (moments broken on the resume change the loss one step late, seed 003), but the
    state comparison is what must catch them.

    Two pairs: the ordinary one from the drift of replays from a saved step, and the from-init one
    (`cross_mesh_init_*`, never below the ordinary) from the replays from the init, which only a full
    proof's first interval needs (verifier/tolerances.py for_anchor): folding the far larger from-init
    drift into one bound would loosen every later interval's too."""
    loss_rtol = safety * max(row["loss_drift"] for row in rows)
    state_rtol = safety * max(row["state_drift"] for row in rows)
    init_loss_rtol = max(loss_rtol, safety * max(row["init_loss_drift"] for row in rows))
    init_state_rtol = max(state_rtol, safety * max(row["init_state_drift"] for row in rows))
    # Noise leaves differ by up to their own movement plus the other replay's (about 2x): 2x over that.
    noise_factor = max(default_noise_factor, 2.0 * max(row["noise_drift"] for row in rows))
    smallest_state = min(min(row["state_signal"].values()) for row in rows)
    later = [min(row["loss_signal"].values()) for row in rows if row["steps"] >= 2]

    def too_close(what: str, bound: float, prove: str) -> str:  # '' when the bound separates them
        return "" if bound * signal_margin <= smallest_state else (
            f"{what} {bound:.2g} exceeds 1/{signal_margin:g} of the smallest broken-resume signal "
            f"{smallest_state:.2g}: prove {prove} on its recording layout")

    reason = too_close("the state bound", state_rtol, "this model")
    init_reason = too_close("the from-init state bound", init_state_rtol, "its first interval")
    return {"cross_mesh_loss_rtol": loss_rtol, "cross_mesh_state_rtol": state_rtol,
            "cross_mesh_init_loss_rtol": init_loss_rtol, "cross_mesh_init_state_rtol": init_state_rtol,
            "noise_ratio": noise_ratio, "noise_factor": noise_factor,
            "provable_across_layouts": not reason, "reason": reason,
            "first_interval_provable_across_layouts": not reason and not init_reason, "init_reason": init_reason,
            "safety": safety, "signal_margin": signal_margin, "smallest_state_signal": smallest_state,
            "loss_separates": bool(later) and loss_rtol * signal_margin <= min(later),
            "smallest_loss_signal": min(later) if later else None}


def table(rows: list[dict], derived: dict) -> str:
    """The result table: one line per window, then the tolerances."""
    lines = [f"{'steps':>5} {'loss drift':>10} {'state drift':>11} {'noise drift':>11} {'loss signal':>11} "
             f"{'state signal':>12} {'loss margin':>11} {'state margin':>12} {'from init':>9}  worst leaf"]
    for row in rows:
        lines.append(f"{row['steps']:>5} {row['loss_drift']:>10.2e} {row['state_drift']:>11.2e} "
                     f"{row['noise_drift']:>11.2f} {min(row['loss_signal'].values()):>11.2e} "
                     f"{min(row['state_signal'].values()):>12.2e} {row['loss_margin']:>11.3g} "
                     f"{row['state_margin']:>12.3g} {row['init_state_drift']:>9.2e}  {row['state_drift_leaf']}")
    lines.append(f"cross_mesh_loss_rtol {derived['cross_mesh_loss_rtol']:.2g}  cross_mesh_state_rtol "
                 f"{derived['cross_mesh_state_rtol']:.2g}  noise_ratio {derived['noise_ratio']:g}  noise_factor "
                 f"{derived['noise_factor']:g}  (x{derived['safety']:g} the drift)")
    lines.append(f"from the init: cross_mesh_init_loss_rtol {derived['cross_mesh_init_loss_rtol']:.2g}  "
                 f"cross_mesh_init_state_rtol {derived['cross_mesh_init_state_rtol']:.2g}")
    lines.append("provable across layouts" if derived["provable_across_layouts"] else
                 f"NOT provable across layouts: {derived['reason']}")
    if derived["provable_across_layouts"] and not derived["first_interval_provable_across_layouts"]:
        lines.append(f"its first interval (from the init) is NOT provable across layouts: {derived['init_reason']}")
    if not derived["loss_separates"]:
        lines.append("the loss bound alone does not separate the broken resumes: the state comparison must")
    return "\n".join(lines)
