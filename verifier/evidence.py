"""When a replay's difference from the record is evidence: beyond the noise of a layout change, measured for
this run and this interval, times MARGIN. One owner for the rule a cross-layout verdict rests on.

The verifier replays an interval on its own layout and as two members perturbed at the rounding level, one on
another layout and one on its own (verifier/ensemble.py, verifier/perturb.py; one more member confirms evidence
before a step fails). Mathematically the replays are one computation; in floats they spread as far as rounding can carry
an execution: that is the noise, measured here per quantity and pair of replays, never declared. For each
recorded quantity (a loss, a leaf of the state, a leaf's probe sum and norm):

    distance = |recorded - replay on the verifier's layout|       (a norm, for a leaf)
    noise    = the largest |replay_i - replay_j|, at least FLOOR_ULPS of the quantity's dtype (two
               replays may agree bit for bit on a quantity the recording layout rounds differently)
    evidence when not distance <= MARGIN * noise  (NaN and Inf fail)

Losses pool their noise over the interval (the largest relative difference of any step): one loss is one
sample, too few to estimate a spread from. A leaf is chaotic when its noise is at least CHAOTIC of its
scale (the larger of its norm and how far it moved): its value is rounding that an optimizer amplified (a
bias before BatchNorm gets no gradient but noise, and Adam turns noise into full steps), so it cannot
decide a verdict alone; the losses and the leaves that carry signal do. A quantity whose bound reaches its
own scale cannot tell a broken value from a good one either: when no quantity can decide, the proof is
inconclusive, not passed. Integer leaves (the step, Adam's count) are exact on every layout.

MARGIN is 10, between what the acceptance matrix of docs/verifier.md measured both ways (63 genuine runs of 7
families, intervals 10-100, recorded on 3 layouts, verified on 1-8 devices; 24 broken runs on data=2): a genuine
proof came within 5.3x the spread of its ensemble (a transformer's cheap proof), and every broken run lay beyond
58 (one input element x (1 + 1e-3) at one step), most beyond 10^3. On the recording layout a corruption fails
from its last bit.
"""

import dataclasses
import math

import numpy as np

MARGIN = 10.0
FLOOR_ULPS = 8.0  # a quantity's noise is at least this many units of its dtype's last place, of its scale
CHAOTIC = 0.1  # noise at least this fraction of a leaf's scale: rounding amplified, not signal
FLOAT32_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One recorded quantity beyond MARGIN times its noise."""

    kind: str  # "loss", "leaf", "sum" or "norm"
    where: int | str  # the step of a loss, the key path of a leaf
    recorded: float | None
    replayed: float | None
    ratio: float  # distance / noise (inf: nonzero where the replays agree exactly, or not finite)
    detail: str
    exact: bool = False  # an integer leaf: exact on every layout and platform, so evidence anywhere

    def as_mismatch(self) -> dict:
        return {"kind": "leaf" if self.kind in ("sum", "norm") else self.kind, "where": self.where,
                "expected": self.recorded, "actual": self.replayed}


@dataclasses.dataclass
class Judgement:
    """What the comparisons of one proof found: the evidence, how far the genuine-looking rest went."""

    findings: list[Finding] = dataclasses.field(default_factory=list)
    largest: float = 0.0  # the largest distance / noise among the deciding quantities that passed
    deciding: int = 0  # quantities whose bound is below their scale: they can tell broken from good
    chaotic: list[str] = dataclasses.field(default_factory=list)  # leaves that cannot decide alone
    loss_noise: float | None = None  # the pooled relative noise of the losses
    reason: str = ""  # why nothing could decide, where that is known before comparing (no other layout)
    replays: int = 1  # replays compared: the verifier's own, and the members of its ensemble
    perturbation: float = 0.0  # the largest relative perturbation per step of a member (verifier/perturb.py)

    def add(self, other: "Judgement") -> "Judgement":
        return Judgement(self.findings + other.findings, max(self.largest, other.largest),
                         self.deciding + other.deciding, self.chaotic + other.chaotic,
                         self.loss_noise if other.loss_noise is None else other.loss_noise,
                         self.reason or other.reason, max(self.replays, other.replays),
                         max(self.perturbation, other.perturbation))

    def mismatch(self) -> dict | None:
        """The verdict's mismatch field: the strongest evidence, if any."""
        return self.findings[0].as_mismatch() if self.findings else None

    @property
    def status(self) -> str:
        if self.findings:
            return "fail"
        return "pass" if self.deciding else "inconclusive"

    def as_record(self) -> dict:
        """What a verdict keeps of it (checkpointing/_src/verdicts.py `evidence`)."""
        ratio = max(finding.ratio for finding in self.findings) if self.findings else self.largest
        return {"ratio": ratio if math.isfinite(ratio) else None, "margin": MARGIN, "deciding": self.deciding,
                "chaotic": self.chaotic, "replays": self.replays, "perturbation": self.perturbation}

    def describe(self) -> str:
        """One clause: how close the record came, in units of the noise (for a passing verdict)."""
        text = f"within {self.largest:.2g}x {self.bound_name()} (margin {MARGIN:g})"
        if self.chaotic:
            text += (f"; {len(self.chaotic)} leaf(s) spread as wide as their scale across layouts, judged against "
                     f"that spread ({', '.join(self.chaotic[:3])}{', ...' if len(self.chaotic) > 3 else ''})")
        return text

    def bound_name(self) -> str:
        """How the bound was established, for a verdict's detail."""
        if self.perturbation:
            return (f"the spread of {self.replays} replays, {self.replays - 1} perturbed by up to "
                    f"{self.perturbation:.1e} per step")
        return "the noise of a layout change measured here"


def exact(mismatch) -> Judgement:
    """The judgement of a bit-exact comparison (the recording layout and platform): any difference is evidence.
    `mismatch`: checkpointing._src.compare.Mismatch or None."""
    if mismatch is None:
        return Judgement(deciding=1)
    return Judgement([Finding(mismatch.kind, mismatch.where, mismatch.expected, mismatch.actual, math.inf,
                              mismatch.detail)])


def _ratio(distance: float, noise: float) -> float:
    if not math.isfinite(distance):
        return math.inf
    return distance / noise if noise > 0 else (0.0 if distance == 0 else math.inf)


def judge_losses(recorded: dict[int, float], replays: list[dict[int, float]], floor_rtol: float = 0.0) -> Judgement:
    """The recorded losses against replays[0] (the verifier's layout), the noise from all the replays' pairs.
    `floor_rtol`: a relative bound the run's program declares (a floor, never the rule)."""
    steps = sorted(recorded)
    pairs = [(a, b) for i, a in enumerate(replays) for b in replays[i + 1:]]
    relative = [abs(a[s] - b[s]) / max(abs(b[s]), 1e-30) for a, b in pairs for s in steps if s in a and s in b]
    pooled = max(relative, default=0.0)
    if not all(math.isfinite(v) for v in relative):
        pooled = math.inf  # replays that disagree on finiteness measure nothing
    noise_rtol = max(pooled, FLOOR_ULPS * FLOAT32_EPS, floor_rtol / MARGIN)
    judgement = Judgement(loss_noise=pooled)
    for step in steps:
        want, got = recorded[step], replays[0].get(step, math.nan)
        scale = abs(got) if math.isfinite(got) else math.nan
        ratio = _ratio(abs(want - got), noise_rtol * scale) if math.isfinite(want) else math.inf
        if not ratio <= MARGIN:
            judgement.findings.append(Finding(
                "loss", step, want, got, ratio,
                f"loss of step {step}: replayed {got!r}, recorded {want!r}: "
                f"{_times(ratio)} the spread of the replays measured here ({noise_rtol:.2g} relative)"))
            break  # blame the first step that diverged: the later ones follow from it
        if noise_rtol < 1 / MARGIN:
            judgement.deciding += 1
        judgement.largest = max(judgement.largest, ratio)
    return judgement


@dataclasses.dataclass(frozen=True)
class LeafNumbers:
    """One leaf's norms, computed on device (verifier/layouts.py leaf_numbers)."""

    distance: float  # ||recorded - replays[0]||
    noise: float  # the largest ||replay_i - replay_j||
    norm: float  # ||replays[0]||
    moved: float  # ||replays[0] - the anchor||
    finite_replays: int  # how many replays hold only finite values (the record's were checked when restored)
    replays: int
    is_float: bool
    eps: float  # the dtype's machine epsilon (0 for integers)


def judge_leaves(numbers: dict[str, LeafNumbers], floor_rtol: float = 0.0) -> Judgement:
    """The recorded state against the replays, leaf by leaf (the module docstring's rule)."""
    judgement = Judgement()
    for path in sorted(numbers):
        leaf = numbers[path]
        if not leaf.is_float:  # counters: exact on any layout and platform
            if not leaf.distance == 0:
                judgement.findings.append(Finding("leaf", path, None, leaf.distance, math.inf,
                                                  f"leaf {path} differs (an integer leaf: exact on every layout)",
                                                  exact=True))
            continue
        scale = max(leaf.norm, leaf.moved)
        noise = max(leaf.noise, FLOOR_ULPS * leaf.eps * scale, floor_rtol * scale / MARGIN)
        if leaf.finite_replays == 0:  # every replay diverged where the recorded state is finite
            judgement.findings.append(Finding("leaf", path, None, None, math.inf,
                                              f"leaf {path}: every replay holds NaN or Inf, the checkpoint does not"))
            continue
        if leaf.finite_replays < leaf.replays:  # replays that disagree on finiteness bound nothing
            judgement.chaotic.append(path)
            continue
        # A leaf whose spread is as wide as its scale is judged against that spread all the same: the bound
        # is wide, never absent (a BatchNorm mean moved by +3.0 lies far beyond its genuine spread).
        chaotic = scale > 0 and not leaf.noise < CHAOTIC * scale
        if chaotic:
            judgement.chaotic.append(path)
        ratio = _ratio(leaf.distance, noise)
        if not ratio <= MARGIN:
            judgement.findings.append(Finding(
                "leaf", path, None, leaf.distance, ratio,
                f"leaf {path} differs by {leaf.distance:.3e} (norm; {leaf.distance / max(scale, 1e-30):.2e} of its "
                f"scale): {_times(ratio)} the spread of the replays measured here ({noise:.2e})"))
            continue
        if not chaotic and (MARGIN * noise < scale or scale == 0):
            judgement.deciding += 1
        judgement.largest = max(judgement.largest, ratio)
    judgement.findings.sort(key=lambda finding: -finding.ratio)  # the strongest evidence first
    return judgement


def judge_summaries(recorded: dict, replays: list[dict], sizes: dict[str, int], integer: set[str],
                    step: int, floor_rtol: float = 0.0) -> Judgement:
    """A probe's per-leaf [sum, norm] at `step` against the replays' (the cheap proof across layouts).
    Sums are bounded at the scale sqrt(size) * norm, as |sum| <= sqrt(size) * ||x||."""
    judgement = Judgement()
    for path in sorted(set(recorded) | set(replays[0])):
        if path not in recorded or path not in replays[0]:
            judgement.findings.append(Finding("leaf", path, None, None, math.inf,
                                              f"leaf {path} is in only one of the replayed state and the trainer's "
                                              f"summaries of step {step}"))
            continue
        values = [recorded[path]] + [replay[path] for replay in replays]
        if not all(math.isfinite(v) for pair in values for v in pair):
            judgement.findings.append(Finding("leaf", path, None, None, math.inf,
                                              f"leaf {path} at step {step}: a sum or norm is not finite"))
            continue
        norm = abs(replays[0][path][1])
        if path in integer:  # exact values; the norm is a float32 square root, which a TPU rounds otherwise
            (want_sum, want_norm), (got_sum, got_norm) = recorded[path], replays[0][path]
            if not (want_sum == got_sum and abs(want_norm - got_norm) <= FLOOR_ULPS * FLOAT32_EPS * norm):
                judgement.findings.append(Finding("sum", path, want_sum, got_sum, math.inf,
                                                  f"leaf {path} at step {step}: replayed sum and norm "
                                                  f"{replays[0][path]}, the trainer's {recorded[path]} (an "
                                                  "integer leaf: exact)", exact=True))
            continue
        noise_norm = max((abs(a[path][1] - b[path][1]) for i, a in enumerate(replays) for b in replays[i + 1:]),
                         default=0.0)
        chaotic = norm > 0 and not noise_norm < CHAOTIC * norm
        if chaotic:  # judged against its wide spread all the same (judge_leaves)
            judgement.chaotic.append(path)
        for index, name in ((0, "sum"), (1, "norm")):
            scale = norm * (math.sqrt(max(sizes.get(path, 1), 1)) if name == "sum" else 1.0)
            measured = max((abs(a[path][index] - b[path][index]) for i, a in enumerate(replays)
                            for b in replays[i + 1:]), default=0.0)
            noise = max(measured, FLOOR_ULPS * FLOAT32_EPS * scale, floor_rtol * scale / MARGIN)
            want, got = recorded[path][index], replays[0][path][index]
            ratio = _ratio(abs(want - got), noise)
            if not ratio <= MARGIN:
                judgement.findings.append(Finding(
                    name, path, want, got, ratio,
                    f"leaf {path} at step {step}: replayed {name} {got!r}, the trainer's {want!r}: {_times(ratio)} "
                    f"the spread of the replays measured here ({noise:.2e})"))
                break
            judgement.largest = max(judgement.largest, ratio)
        else:
            bound = MARGIN * max(noise_norm, FLOOR_ULPS * FLOAT32_EPS * norm, floor_rtol * norm / MARGIN)
            if not chaotic and bound < norm:
                judgement.deciding += 1
    judgement.findings.sort(key=lambda finding: -finding.ratio)
    return judgement


def _times(ratio: float) -> str:
    return "beyond any multiple of" if not math.isfinite(ratio) else f"{ratio:.3g}x"
