"""A picture of a run: the loss against the step over the whole history, and the proof beside it.

One numbering (docs/training.md#step-numbering): x is the state's step counter. The loss of step
s (the update s -> s + 1) is drawn at x = s; checkpoint N (the state at counter N, holding losses
of steps below N) is drawn at x = N, where the losses it holds end, at the height of its last one
(step N - 1); preemptions, resumes and crashes are drawn at the counter they happened at.

`series(workdir)` prepares everything the loss panel shows (and nothing else is drawn):
  loss          the run's history (checkpointing/_src/history.py: metrics.jsonl and the manifests,
                whatever retention deleted), (steps, values)
  attempts      each start of the job with the losses it recorded (a resume recomputes steps
                a crash lost: both attempts are drawn)
  checkpoints   one point per committed step, coloured by the verifier's verdict
  preemptions   the steps saved with reason `preemption`
  resumes       where each attempt after the first started, with its layout and tier
  crashes       where an attempt that ended unsaved stopped, from its own records (its last logged
                step + 1), when the next attempt did not start at a preemption or final checkpoint
                that attempt made: a crash, a kill, a rollback
  evals         the eval loss of each step that has one
`proof_series(run, reference, tolerance)` prepares the second panel: each step's relative
difference to an uninterrupted reference run, exact zeros on a marked floor.
`draw(...)` (checkpointing/_src/plot_draw.py) renders them with matplotlib's Agg backend, PNG or SVG.
"""

import dataclasses
import math

from checkpointing._src import verdicts
from checkpointing.config import format_mesh
from checkpointing._src.history import Attempt, read_history
from checkpointing._src.workdir import committed_steps, read_manifest

FORMATS = (".png", ".svg")
VERDICT_COLOURS = {"reproduced pass": "tab:green", "resumes pass": "yellowgreen", "replayed pass": "tab:olive",
                   "intact pass": "tab:cyan", "fail": "tab:red", "inconclusive": "goldenrod", "error": "black",
                   "gone": "tab:gray", "-": "tab:gray"}


@dataclasses.dataclass
class Checkpoint:
    step: int  # drawn at x = step
    loss: float | None  # its last loss: step - 1's (the update that made this state)
    verdict: str  # verdicts.summary(...)
    colour: str


@dataclasses.dataclass
class Resume:
    step: int  # the counter the attempt started at
    layout: str  # "data=8,model=1 (4 processes)"
    tier: str | None  # "local", "persistent" (None: not recorded)


@dataclasses.dataclass
class Series:
    loss_steps: list[int]
    loss_values: list[float]
    checkpoints: list[Checkpoint]
    preemptions: list[int]
    resumes: list[Resume]
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    crashes: list[int] = dataclasses.field(default_factory=list)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_values: list[float] = dataclasses.field(default_factory=list)

    def spans(self) -> list[tuple[int, int, Attempt]]:
        """[start, end) of the steps whose history each attempt holds (the next attempt's start ends it)."""
        starts = [a.first_step for a in self.attempts]
        end_of_run = (self.loss_steps[-1] + 1) if self.loss_steps else 0
        spans = []
        for index, attempt in enumerate(self.attempts):
            if starts[index] is None:
                continue
            end = next((s for s in starts[index + 1:] if s is not None), None)
            end = end if end is not None else max(end_of_run, (attempt.last_step or 0) + 1)
            spans.append((starts[index], end, attempt))
        return spans


@dataclasses.dataclass
class Proof:
    steps: list[int]  # the steps both runs recorded
    differences: list[float]  # |run - reference| / |reference| (0 where equal; inf where reference is 0)
    plotted: list[float]  # what the log-scale panel draws: exact zeros at `floor`, NaN/inf at `ceiling`
    floor: float
    ceiling: float
    tolerance: float
    exact_steps: list[int]  # the steps bit-identical to the reference


def colour_of(verdict: dict | None) -> str:
    if verdict is None:
        return VERDICT_COLOURS["-"]
    if verdict["status"] != "pass":
        return VERDICT_COLOURS[verdict["status"]]
    return VERDICT_COLOURS[f"{verdict['level']} pass"]


def _manifest_resumes(manifests: dict[int, dict]) -> list[Resume]:
    """Resumes where no attempt recorded its layout: after each preemption, and where the layout changes."""
    resumes, previous = [], None
    for step in sorted(manifests):
        manifest = manifests[step]
        if previous is not None and (previous["reason"] == "preemption" or previous["mesh"] != manifest["mesh"]
                                     or previous["process_count"] != manifest["process_count"]):
            resumed = (manifest.get("extra") or {}).get("resumed_from") or {}
            resumes.append(Resume(previous["step"],
                                  f"{format_mesh(manifest['mesh'])} ({manifest['process_count']} processes)",
                                  resumed.get("tier")))
        previous = manifest
    return resumes


def _crashes(attempts: list[Attempt], clean_ends: set[int]) -> list[int]:
    """Where each attempt that ended unsaved (a crash, a kill) stopped: the step its own records reached
    (Attempt.reached), whatever step the next attempt resumed from. An attempt ended saved when the next
    one started at a preemption or final checkpoint made after it began: that checkpoint is its end,
    drawn as the preemption, even where its records stop short of it (metrics.jsonl is a convenience
    copy: an append that failed on a full disk is a warning, not a stop)."""
    crashes = []
    for attempt, following in zip(attempts, attempts[1:]):
        start = following.first_step
        if start in clean_ends and (attempt.first_step or 0) < start:
            continue
        if attempt.reached is not None:
            crashes.append(attempt.reached)
    return crashes


def series(workdir: str) -> Series:
    """Reads the committed manifests (and their verdicts) and metrics.jsonl of `workdir` once."""
    steps = committed_steps(workdir)
    manifests = {step: read_manifest(workdir, step) for step in steps}
    found = verdicts.read_steps(workdir, steps)
    history = read_history(workdir, manifests)
    losses = history.losses
    checkpoints = [Checkpoint(step, losses.get(step - 1), verdicts.summary(found.get(step)), colour_of(found.get(step)))
                   for step in steps]
    preemptions = [step for step in steps if manifests[step]["reason"] == "preemption"]
    if history.attempts and all(a.layout for a in history.attempts):
        resumes = [Resume(a.first_step, a.layout, a.tier) for a in history.attempts[1:] if a.first_step is not None]
    else:
        resumes = _manifest_resumes(manifests)
    evals = {s: v["eval_loss"] for s, v in history.evals.items() if "eval_loss" in v}
    return Series(list(losses), list(losses.values()), checkpoints, preemptions, resumes, history.attempts,
                  _crashes(history.attempts, {s for s in steps if manifests[s]["reason"] in ("preemption", "final")}),
                  list(evals), list(evals.values()))


def summary(run: Series) -> str:
    """What a picture's title says of a run beside its name: '300 steps in 3 attempts (1 preemption, 1 crash);
    6 checkpoints, 5 reproduced pass'."""
    def count(number: int, noun: str) -> str:
        return f"{number} {noun}{'' if number == 1 else 's'}"

    steps = (run.loss_steps[-1] + 1) if run.loss_steps else 0
    text = f"{count(steps, 'step')} in {count(max(len(run.attempts), 1), 'attempt')}"
    faults = [count(len(found), noun) for found, noun in ((run.preemptions, "preemption"), (run.crashes, "crash"))
              if found]
    if faults:
        text += f" ({', '.join(faults).replace('crashs', 'crashes')})"
    text += f"; {count(len(run.checkpoints), 'checkpoint')}"
    verdicts_found: dict[str, int] = {}
    for point in run.checkpoints:
        if point.verdict != "-":
            verdicts_found[point.verdict] = verdicts_found.get(point.verdict, 0) + 1
    if verdicts_found:
        text += ", " + ", ".join(f"{n} {verdict}" for verdict, n in sorted(verdicts_found.items()))
    elif run.checkpoints:
        text += ", none verified yet"
    return text


def title(workdir: str, run: Series) -> str:
    """A picture's title: the workdir and its parent ('runs/lm', not the machine's whole path) and summary()."""
    name = "/".join(workdir.rstrip("/").rsplit("/", 2)[-2:]).lstrip("/") or workdir
    return f"{name}: {summary(run)}"


def reference_loss(workdir: str) -> tuple[list[int], list[float]]:
    """The whole history of a reference run, (steps, losses)."""
    losses = read_history(workdir).losses
    return list(losses), list(losses.values())


def relative_difference(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    if reference == 0.0:
        return math.inf
    return abs(value - reference) / abs(reference)  # NaN stays NaN


def proof_series(run: Series, reference: tuple[list[int], list[float]], tolerance: float) -> Proof:
    """Each step's |run - reference| / |reference| over the steps both recorded. The log scale cannot
    show 0, so exact zeros go on a floor two decades below the smallest nonzero difference (or the
    tolerance), and NaN/inf on a ceiling a decade above the largest (both drawn as marked lines)."""
    expected = dict(zip(*reference))
    steps = [s for s in run.loss_steps if s in expected]
    values = dict(zip(run.loss_steps, run.loss_values))
    differences = [relative_difference(values[s], expected[s]) for s in steps]
    finite = [d for d in differences if math.isfinite(d)]
    nonzero = [d for d in finite if d > 0] + ([tolerance] if tolerance > 0 else [])
    # Decades by log10 with a hair of slack: 1e-4 computed as 1.00000000000006e-4 is still decade -4.
    floor = 10.0 ** (math.floor(math.log10(min(nonzero)) + 1e-9) - 2) if nonzero else 1e-12
    ceiling = 10.0 ** (math.ceil(math.log10(max(finite + [tolerance, floor])) - 1e-9) + 1)
    plotted = [floor if d == 0 else (d if math.isfinite(d) else ceiling) for d in differences]
    return Proof(steps, differences, plotted, floor, ceiling, tolerance,
                 [s for s, d in zip(steps, differences) if d == 0])
