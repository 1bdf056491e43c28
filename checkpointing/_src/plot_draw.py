"""Renders plot.py's series: the loss panel and, with a proof, the relative-difference panel.

Nothing here computes what is drawn (plot.py does, and tests read it there). Text never sits on
the curves: every description is a legend entry, and the legend stands below the axes, in columns.

The loss of step s is drawn as a level over [s, s + 1) (the update s -> s + 1), so checkpoint N's
last loss ends exactly at x = N, where its marker sits, and the eval of step N starts there.
"""

import io
import math
import textwrap

from etils import epath

from checkpointing._src.plot import Proof, Series

LAYOUT_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")


def _levels(steps: list[int], values: list[float]) -> tuple[list[float], list[float]]:
    """Points for drawstyle="steps-post": each value held over [s, s + 1), the last one included."""
    if not steps:
        return [], []
    return list(steps) + [steps[-1] + 1], list(values) + [values[-1]]


def _origin(attempt) -> str:
    if not attempt.first_step and attempt.tier is None:
        return "fresh"
    return f"from {attempt.tier or 'checkpoint'} step {attempt.first_step}"


def _shade(axes, run: Series, labelled: bool) -> None:
    """Each attempt's span of the history, coloured by its layout (alternating depth per attempt)."""
    colours: dict[str, str] = {}
    for index, (start, end, attempt) in enumerate(run.spans()):
        colour = colours.setdefault(attempt.layout or "?", LAYOUT_COLOURS[len(colours) % len(LAYOUT_COLOURS)])
        label = f"attempt {attempt.number}: {attempt.layout or 'layout not recorded'}, {_origin(attempt)}"
        axes.axvspan(start, end, color=colour, alpha=0.10 if index % 2 else 0.18, linewidth=0,
                     label=label if labelled else None)


def _events(axes, run: Series, crash_label: str, labelled: bool) -> None:
    """A resume marks the lower half of the axes and a crash the upper half, so both show where an
    attempt resumes at the step its predecessor crashed; a preemption spans the whole height."""
    for index, resume in enumerate(run.resumes):
        axes.axvline(resume.step, ymax=0.5, color="tab:purple", linestyle="--", linewidth=1.4,
                     label="resume (an attempt starts)" if labelled and index == 0 else None)
    for index, step in enumerate(run.crashes):
        # At the end of the crashed attempt's shading: where the next attempt took over (its resume, drawn in
        # the lower half) when that is before the crash; the steps it lost beyond are the dotted orange line.
        step = next((start for start, end, _ in run.spans() if start < step < end), step)
        axes.axvline(step, ymin=0.5, color="black", linestyle="-.", linewidth=1.4,
                     label=f"{crash_label}: its attempt ends (later steps redone)" if labelled and index == 0 else None)
    for index, step in enumerate(run.preemptions):
        axes.axvline(step, color="tab:red", linestyle=":", linewidth=2.2,
                     label="preemption (saved, exit 75)" if labelled and index == 0 else None)


def _loss_panel(axes, run: Series, reference, crash_label: str) -> None:
    _shade(axes, run, labelled=True)
    if reference is not None:  # wide and pale underneath: visible beside the run, and under it where equal
        axes.plot(*_levels(*reference), drawstyle="steps-post", color="0.55", linewidth=4.0, alpha=0.55,
                  label="uninterrupted reference run", zorder=2)
    axes.plot(*_levels(run.loss_steps, run.loss_values), drawstyle="steps-post", color="tab:blue", linewidth=1.2,
              label="loss (history)", zorder=3)
    history = dict(zip(run.loss_steps, run.loss_values))
    shown = False
    for attempt in run.attempts:  # what an attempt computed that a later one recomputed (lost work)
        lost = [(s, v) for s, v in zip(attempt.steps, attempt.losses) if history.get(s) != v]
        if lost:
            axes.plot(*_levels(*map(list, zip(*lost))), drawstyle="steps-post", color="tab:orange", linestyle=":",
                      linewidth=1.4, zorder=3,
                      label=None if shown else "an attempt's losses later recomputed")
            shown = True
    verdicts_shown = set()
    for point in (c for c in run.checkpoints if c.loss is not None):
        label = None if point.verdict in verdicts_shown else f"checkpoint: {point.verdict}"
        verdicts_shown.add(point.verdict)
        axes.scatter([point.step], [point.loss], color=point.colour, s=36, zorder=5, label=label,
                     edgecolors="black", linewidths=0.5)
    if run.eval_steps:  # hollow and beneath: an eval at a checkpoint's step leaves its verdict's colour seen
        axes.scatter(run.eval_steps, run.eval_values, marker="D", s=40, facecolors="none", edgecolors="tab:orange",
                     linewidths=1.2, zorder=4, label="eval loss (held-out batches)")
    _events(axes, run, crash_label, labelled=True)
    axes.set_ylabel("loss")
    values = run.loss_values + run.eval_values + (list(reference[1]) if reference else [])
    if values and min(values) > 0:
        axes.set_yscale("log")


def _proof_panel(axes, run: Series, proof: Proof, crash_label: str) -> None:
    _shade(axes, run, labelled=False)
    axes.plot(*_levels(proof.steps, proof.plotted), drawstyle="steps-post", color="tab:blue", linewidth=0.9,
              zorder=3, label="|resumed - uninterrupted| / |uninterrupted|")
    exact = [s for s, d in zip(proof.steps, proof.differences) if d == 0]
    axes.axhline(proof.floor, color="tab:green", linewidth=1.0, zorder=2,
                 label=f"exact: 0 (drawn at {proof.floor:.0e}), {len(exact)} of {len(proof.steps)} steps")
    if exact:  # at the middle of the step's level
        axes.scatter([s + 0.5 for s in exact], [proof.floor] * len(exact), color="tab:green", s=14, zorder=4)
    if proof.tolerance > 0:
        axes.axhline(proof.tolerance, color="tab:red", linestyle="--", linewidth=1.2, zorder=2,
                     label=f"tolerance {proof.tolerance:g} (another layout)")
    if any(not math.isfinite(d) for d in proof.differences):
        axes.axhline(proof.ceiling, color="black", linewidth=1.0, label=f"NaN or inf (drawn at {proof.ceiling:.0e})")
    _events(axes, run, crash_label, labelled=False)
    axes.set_yscale("log")
    axes.set_ylim(proof.floor / 3, proof.ceiling * 3)
    axes.set_ylabel("relative difference")


def _title(picture, title: str) -> None:
    """The title over the whole figure, legend included, wrapped to the figure's width (a long workdir name
    is broken where it must be): constrained layout then reserves the height of every line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    text = picture.suptitle(title, fontsize="large")
    renderer = FigureCanvasAgg(picture).get_renderer()  # measures the text as the PNG draws it
    room = 0.96 * picture.bbox.width
    columns = len(title)
    while columns > 8 and not (text.get_window_extent(renderer).width <= room):
        columns = max(8, int(columns * min(room / text.get_window_extent(renderer).width, 0.95)))
        text.set_text(textwrap.fill(title, columns, break_long_words=True, break_on_hyphens=False))


def figure(run: Series, *, title: str, reference=None, proof: Proof | None = None, crash_label: str = "crash"):
    """The picture as a matplotlib Figure (Agg: no display), not yet drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    from matplotlib.figure import Figure

    picture = Figure(figsize=(12, 8 if proof else 5), layout="constrained")
    if proof is None:
        loss_axes, proof_axes = picture.add_subplot(), None
    else:
        loss_axes, proof_axes = picture.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    _loss_panel(loss_axes, run, reference, crash_label)
    _title(picture, title)
    if proof_axes is not None:
        _proof_panel(proof_axes, run, proof, crash_label)
    # One legend under the panels, in columns (constrained layout makes room for it): beside them, the long
    # attempt entries took a third of the width.
    entries: dict[str, object] = {}
    for axes in picture.axes:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    picture.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=3, fontsize=8,
                   framealpha=0.9)
    (proof_axes or loss_axes).set_xlabel("step (the loss of step s, computed by the update s -> s+1, is drawn "
                                         "over [s, s+1); checkpoint N at N)")
    return picture


def draw(run: Series, path: str, *, title: str, reference=None, proof: Proof | None = None,
         crash_label: str = "crash") -> None:
    """Writes the picture to `path` (local, gs:// or s3://), PNG or SVG by its extension."""
    buffer = io.BytesIO()
    figure(run, title=title, reference=reference, proof=proof, crash_label=crash_label).savefig(
        buffer, format=path.rsplit(".", 1)[-1].lower())
    epath.Path(path).write_bytes(buffer.getvalue())
