"""Declared cross-layout tolerances: what `python -m verifier.calibrate` measures and the rule it measures them
with. Proofs no longer decide by them (verifier/evidence.py measures the noise of each interval); a program's
rtols and a calibrate file given with --tolerances are floors under that noise (verifier/program.py floors).

The rule calibrate measures by (`state_tolerances`): per leaf, ||replayed - saved|| at most the state rtol
times the larger of ||replayed|| and how far the leaf moved during the replay; a leaf whose Adam first moment
is below NOISE_RATIO of the largest (rounding noise, an attention key bias) may also differ by NOISE_FACTOR
times its movement; integer leaves equal.
"""

import dataclasses
import math
import re

from checkpointing.verification import leaf_differences

NOISE_RATIO = 1e-5  # RMS of a leaf's Adam mu below this fraction of the largest: noise-driven
NOISE_FACTOR = 4.0  # measured up to 1.6x its movement across the four 8-device meshes

# .params[...] and its optimizer leaves share a suffix: .opt_state[0].mu[...], .nu[...], and under a
# chain (clipping) or optax.MultiSteps (accumulation) .opt_state.inner_opt_state[1][0].mu[...] and
# .opt_state.acc_grads[...]. The model state (.model_state['batch_stats'][...]) is a float leaf like any
# other; integer leaves (the step, counts, MultiSteps' mini_step, a stored key's words) are exact.
_OPT_PATH = r"opt_state(?:\.\w+|\[\d+\])*?"
PARAM_LEAF = re.compile(rf"^\.(?:params|{_OPT_PATH}\.(?:mu|nu|acc_grads))(\[.*)$")
_FIRST_MOMENT = re.compile(rf"^\.{_OPT_PATH}\.mu(\[.*)$")


@dataclasses.dataclass(frozen=True)
class Measured:
    """The tolerances of a `python -m verifier.calibrate` file (the verifier's --tolerances): they
    replace every program's own (verifier/program.py with_tolerances)."""

    path: str
    loss_rtol: float
    state_rtol: float
    init_loss_rtol: float
    init_state_rtol: float
    model: str | None = None  # what it was measured for, as the file records it (None: not recorded)
    fixed_fields: dict | None = None

    def describe(self) -> str:
        return (f"{self.path}: loss rtol {self.loss_rtol:.2g}, state rtol {float(self.state_rtol):.2g}; from the "
                f"init {self.init_loss_rtol:.2g} and {float(self.init_state_rtol):.2g}")

    def differences(self, config: dict) -> list[str]:
        """The fixed fields (else the model) of a run's recorded `config` that differ from the file's."""
        if self.fixed_fields:
            return sorted(name for name, value in self.fixed_fields.items() if config.get(name) != value)
        return ["model"] if self.model is not None and config.get("model") != self.model else []


def read_measured(path: str) -> Measured:
    """The file's tolerances; a one-line ConfigError naming it when it is missing, garbled, or says the
    model cannot be proved across layouts (trainer/models/measured.py reads the format)."""
    from trainer.models import measured  # the reader of the file calibrate writes

    content = measured.read_tolerances_file(path)
    loss, state = measured.tolerances_in(content, path)
    init_loss, init_state = measured.tolerances_in(content, path, from_init=True)
    fixed = content.get("fixed_fields")
    return Measured(path, loss, state, init_loss, init_state, content.get("model"),
                    fixed if isinstance(fixed, dict) else None)


def noise_rule(rtol) -> tuple[float, float]:
    """(noise ratio, noise factor) of a state rtol: the defaults, or those a spec measured for its
    config (a trainer.models.StateTolerance, e.g. bfloat16 compute, carries its own)."""
    ratio, factor = getattr(rtol, "noise_ratio", None), getattr(rtol, "noise_factor", None)
    return (NOISE_RATIO if ratio is None else float(ratio)), (NOISE_FACTOR if factor is None else float(factor))


def moment_rms(movement: dict, leaves: dict[str, dict]) -> dict[str, float]:
    """{parameter suffix: RMS of its Adam first moment} of the replayed state."""
    return {m.group(1): norm / math.sqrt(max(math.prod(leaves[path]["shape"]), 1))
            for path, (_, norm, _) in movement.items() if (m := _FIRST_MOMENT.match(path))}


def noise_leaves(movement: dict, leaves: dict[str, dict], noise_ratio: float = NOISE_RATIO) -> set[str]:
    """The key paths (a parameter and its optimizer leaves) whose Adam first moment's RMS is at most
    `noise_ratio` of the largest one: leaves driven by rounding noise. `movement` is
    leaf_differences(anchor, replayed)."""
    rms = moment_rms(movement, leaves)
    largest = max(rms.values(), default=0.0)
    noise = {suffix for suffix, value in rms.items() if value <= noise_ratio * largest}
    return {path for path in movement if (match := PARAM_LEAF.match(path)) and match.group(1) in noise}


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def state_tolerances(replayed, anchor, rtol: float, leaves: dict[str, dict]) -> dict[str, float]:
    """{key path: largest ||replayed - saved|| allowed} for a replay from `anchor` on another layout.

    `leaves` is the manifest's leaf table (shape and dtype per key path); integer leaves get 0.
    """
    movement = leaf_differences(anchor, replayed)  # path -> (||anchor - replayed||, ||replayed||, finite)
    noise_ratio, noise_factor = noise_rule(rtol)
    noise = noise_leaves(movement, leaves, noise_ratio)
    tolerances = {}
    for path, (moved, norm, _) in movement.items():
        if not is_float(leaves[path]["dtype"]):
            tolerances[path] = 0.0
            continue
        tolerances[path] = float(rtol) * max(norm, moved) + (noise_factor * moved if path in noise else 0.0)
    return tolerances
