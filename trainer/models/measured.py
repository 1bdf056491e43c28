"""The tolerances a spec carries, as measured: `StateTolerance` (a state rtol with its own noise rule)
and `load_tolerances`, the reader of the JSON `python -m verifier.calibrate --out` writes.

A calibrate file holds two pairs of rtols: the ordinary ones, for an interval replayed from a saved
step, and the from-init ones (`cross_mesh_init_loss_rtol`, `cross_mesh_init_state_rtol`), for a full
proof's first interval, replayed from the config's init, where Adam's first update (g/|g|) turns a
gradient's rounding noise into a whole-learning-rate step and the drift is far larger.
"""

import json
import math

from trainer.config import ConfigError


class StateTolerance(float):
    """A cross_mesh_state_rtol that also carries its own rule for noise-driven leaves
    (verifier/tolerances.py): a leaf whose Adam first moment's RMS is at most `noise_ratio` of the
    largest may also differ by `noise_factor` times how far it moved. It is a float everywhere else, so
    a spec's `tolerances(config)` may return one where the compute dtype changes the rounding noise
    (bfloat16's is ~6e4 times float32's). None: the verifier's defaults."""

    noise_ratio: float | None
    noise_factor: float | None

    def __new__(cls, rtol: float, noise_ratio: float | None = None, noise_factor: float | None = None):
        value = super().__new__(cls, rtol)
        value.noise_ratio, value.noise_factor = noise_ratio, noise_factor
        return value

    def __repr__(self) -> str:
        return f"StateTolerance({float(self)!r}, noise_ratio={self.noise_ratio!r}, noise_factor={self.noise_factor!r})"

    __str__ = float.__repr__


# The file's keys: (loss, state) rtols of an interval from a saved step, and of one from the init.
ORDINARY_KEYS = ("cross_mesh_loss_rtol", "cross_mesh_state_rtol")
INIT_KEYS = ("cross_mesh_init_loss_rtol", "cross_mesh_init_state_rtol")


def read_tolerances_file(path: str) -> dict:
    """The JSON object of a calibrate file; a one-line ConfigError naming `path` when it cannot be read,
    is not JSON, or lacks (or garbles) a number the verifier reads."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror or type(err).__name__})") from None
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{path}: not a JSON file written by python -m verifier.calibrate "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if not isinstance(measured, dict):
        raise ConfigError(f"{path}: not a JSON object written by python -m verifier.calibrate")
    if not isinstance(measured.get("provable_across_layouts"), bool):
        raise ConfigError(f"{path}: no provable_across_layouts: not written by python -m verifier.calibrate")
    if not measured["provable_across_layouts"]:
        return measured  # load_tolerances refuses it, with the file's reason
    # Files written before the from-init pair existed folded that drift into the ordinary one.
    for key in ORDINARY_KEYS + tuple(k for k in INIT_KEYS if k in measured) + ("noise_ratio", "noise_factor"):
        value = measured.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ConfigError(f"{path}: {key} must be a finite number >= 0, got {value!r}")
    return measured


def load_tolerances(path: str, from_init: bool = False) -> tuple[float, StateTolerance]:
    """(cross_mesh_loss_rtol, cross_mesh_state_rtol) from the JSON `python -m verifier.calibrate --out`
    wrote, for a spec's `tolerances(config)`; with `from_init`, the pair for an interval replayed from
    the init, for its `init_tolerances(config)` (a file without one, or whose first interval cannot be
    proved across layouts: the ordinary pair, so that interval is proved on its recording layout).

    A ConfigError when the file cannot be read (one line, naming it), or when it found the model
    cannot be proved across layouts (its drift comes too close to the broken-resume signals): prove it
    on its recording layout instead."""
    return tolerances_in(read_tolerances_file(path), path, from_init)


def tolerances_in(measured: dict, path: str, from_init: bool = False) -> tuple[float, StateTolerance]:
    """load_tolerances of the object read_tolerances_file(path) returned."""
    if not measured["provable_across_layouts"]:
        raise ConfigError(f"{path}: {measured.get('reason') or 'not provable across layouts'}")
    keys = ORDINARY_KEYS
    if from_init and all(k in measured for k in INIT_KEYS) and measured.get("first_interval_provable_across_layouts"):
        keys = INIT_KEYS
    return float(measured[keys[0]]), StateTolerance(measured[keys[1]], measured["noise_ratio"],
                                                    measured["noise_factor"])
