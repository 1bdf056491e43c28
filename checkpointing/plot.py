"""A picture of a run: the loss against the step, from the committed checkpoints' manifests.

`series(workdir)` prepares everything the picture shows (and nothing else is drawn):
  loss          every recorded per-step loss, (steps, values)
  checkpoints   one point per committed step at its loss, coloured by the verifier's verdict
  preemptions   the steps saved with reason `preemption`
  resumes       where a new process group took over: after each preemption, and wherever the
                mesh or the process count changes, with the mesh it resumed on
`draw(...)` renders it with matplotlib's non-interactive Agg backend, as PNG or SVG by the
file's extension.
"""

import dataclasses
import io

from etils import epath

from checkpointing.config import format_mesh
from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing.workdir import committed_steps, read_manifest

FORMATS = (".png", ".svg")
VERDICT_COLOURS = {"reproduced pass": "tab:green", "replayed pass": "tab:olive", "intact pass": "tab:cyan",
                   "fail": "tab:red", "gone": "tab:gray", "-": "tab:gray"}


@dataclasses.dataclass
class Checkpoint:
    step: int
    loss: float | None  # the loss recorded for the step just before it (the state's last update)
    verdict: str  # verdicts.summary(...)
    colour: str


@dataclasses.dataclass
class Series:
    loss_steps: list[int]
    loss_values: list[float]
    checkpoints: list[Checkpoint]
    preemptions: list[int]
    resumes: list[tuple[int, str]]  # (step, "data=8 (4 processes)")


def colour_of(verdict: dict | None) -> str:
    if verdict is None:
        return VERDICT_COLOURS["-"]
    if verdict["status"] != "pass":
        return VERDICT_COLOURS[verdict["status"]]
    return VERDICT_COLOURS[f"{verdict['level']} pass"]


def series(workdir: str) -> Series:
    """Reads the committed manifests (and their verdicts) of `workdir` once."""
    steps = committed_steps(workdir)
    manifests = {step: read_manifest(workdir, step) for step in steps}
    found = verdicts.read_steps(workdir, steps)
    losses: dict[int, float] = {}
    for manifest in manifests.values():
        losses.update(manifest_lib.losses(manifest))
    checkpoints, preemptions, resumes = [], [], []
    previous = None
    for step in steps:
        manifest = manifests[step]
        checkpoints.append(Checkpoint(step, losses.get(step - 1), verdicts.summary(found.get(step)),
                                      colour_of(found.get(step))))
        if manifest["reason"] == "preemption":
            preemptions.append(step)
        if previous is not None and (previous["reason"] == "preemption" or previous["mesh"] != manifest["mesh"]
                                     or previous["process_count"] != manifest["process_count"]):
            resumes.append((previous["step"],
                            f"{format_mesh(manifest['mesh'])} ({manifest['process_count']} processes)"))
        previous = manifest
    ordered = sorted(losses)
    return Series(ordered, [losses[s] for s in ordered], checkpoints, preemptions, resumes)


def reference_loss(workdir: str) -> tuple[list[int], list[float]]:
    s = series(workdir)
    return s.loss_steps, s.loss_values


def draw(run: Series, path: str, *, title: str, reference: tuple[list[int], list[float]] | None = None) -> None:
    """Writes the picture to `path` (local or gs://), PNG or SVG by its extension."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 5), layout="constrained")
    axes = figure.add_subplot()
    if reference is not None:
        axes.plot(*reference, color="tab:gray", linewidth=1.0, linestyle="--", label="reference run")
    axes.plot(run.loss_steps, run.loss_values, color="tab:blue", linewidth=1.2, label="loss")
    shown = set()
    for point in (c for c in run.checkpoints if c.loss is not None):
        label = None if point.verdict in shown else f"checkpoint: {point.verdict}"
        shown.add(point.verdict)
        axes.scatter([point.step - 1], [point.loss], color=point.colour, s=36, zorder=3, label=label,
                     edgecolors="black", linewidths=0.5)
    for index, step in enumerate(run.preemptions):
        axes.axvline(step, color="tab:red", linestyle=":", label="preemption" if index == 0 else None)
    for step, mesh in run.resumes:
        axes.annotate(f"resumed on {mesh}", xy=(step, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                      va="bottom", ha="right", fontsize=8, color="tab:purple")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    if run.loss_values and min(run.loss_values) > 0:
        axes.set_yscale("log")
    axes.set_title(title)
    axes.legend(loc="upper right", fontsize=8, framealpha=0.8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.rsplit(".", 1)[-1].lower())
    epath.Path(path).write_bytes(buffer.getvalue())
