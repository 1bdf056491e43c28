"""Entry point: python -m verifier.verify --workdir=DIR --mesh=data=2 (--follow | --once)

A separate process with its own devices and mesh. It reads the trainer's checkpoints (never
changes them), proves each committed step (verifier/proofs.py) and writes a verdict per step.
--once verifies what is pending and exits: 0 only if every committed step is proved (a resumes or
reproduced pass); 1 if any failed (evidence), one `error:` line naming the steps; 3 (UNPROVED) if none
failed but some step is not proved (left intact, replayed, inconclusive, or an error: a fault of the
verifier's own, retried by its next run: verifier/faults.py), one `unproved:` line naming each; 2 for
bad input, including flag values under which nothing could be proved. The last line counts the proved,
failed and unproved steps. --follow keeps following until --until_step, or the run's final checkpoint,
is verified, or until SIGTERM; same exit codes. --reverify=STEPS|all redoes those steps'
verdicts (a complete one is otherwise never redone). On a local workdir it notices a commit
within milliseconds (verifier/commit_watch.py); on gs:// it polls with backoff. --tolerances=FILE
compares across layouts with what `python -m verifier.calibrate` measured for the run's model
instead of its spec's.
"""

import math
import os
import signal
import sys
import threading

import jax
from absl import flags, logging

from checkpointing.verification import committed_steps, verdicts
from checkpointing.errors import VerificationFailedError
from checkpointing.verification import check_workdir
from runtime import distributed, entry, exit_codes
from runtime import mesh as mesh_lib
from checkpointing.config import ConfigError
from trainer import compile_cache
from verifier import tolerances
from verifier.ledger import ALL
from verifier.verifier import Verifier, VerifierOptions

# --help lists the main module's flags: the pod's (runtime/distributed.py) are this program's too.
flags.adopt_module_key_flags(distributed)

# The verifier's own flags only: the run's config comes from each manifest, so a trainer flag
# (--steps, --batch_size, ...) given here is an unknown flag, exit 2, never silently ignored.
WORKDIR = flags.DEFINE_string("workdir", None,
                              "The trainer's workdir to verify (local path, gs:// or s3://); read only.")
MESH = flags.DEFINE_string("mesh", "", "The verifier's own mesh, e.g. data=2: it runs on the first that many of "
                           "the visible devices (at most all of them), its other layouts too. Empty: data=<all "
                           "devices>.")

FOLLOW = flags.DEFINE_boolean("follow", False, "Verify steps as they are committed, until the run is done.")
ONCE = flags.DEFINE_boolean("once", False, "Verify the pending steps and exit.")
REPLAY_STEPS = flags.DEFINE_integer("replay_steps", 100, "Replay at most this many steps per checkpoint.",
                                    lower_bound=0)
VERIFY_BUDGET = flags.DEFINE_float(
    "verify_budget", 1.0, "The full proof's compute as a fraction of the training's: 1 replays every save "
    "interval (the chain of trust back to the seed); 0.25 about every fourth; 0 only the final step's. The cheap "
    "proof (a few steps from each checkpoint against what the trainer recorded after it) runs at every save "
    "regardless.", lower_bound=0.0)
# The trainer's flag and default directory: a verifier on the recording layout loads the trainer's step from
# it, and a restarted verifier its own executables (a cold compile of the replay delayed the next verdicts).
COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None, "JAX's persistent compilation cache (local disk per host); unset: the trainer's "
    "default, $XDG_CACHE_HOME (else ~/.cache)/jax-checkpoint-service/compile; empty: no cache.")
UNTIL_STEP = flags.DEFINE_integer("until_step", None, "--follow: exit once this step is committed and verified.")
POLL_SECS = flags.DEFINE_float("poll_secs", 1.0, "--follow: first wait between listings (doubles while idle); "
                               "on a local workdir a commit ends the wait at once.", lower_bound=0.01)
MAX_POLL_SECS = flags.DEFINE_float("max_poll_secs", 30.0, "--follow: longest wait between listings.", lower_bound=0.01)
REVERIFY = flags.DEFINE_string(
    "reverify", "", "Redo these steps' verdicts (a comma list of committed steps, or 'all'), complete ones "
    "included; without it a complete verdict of a step's save is never redone.")
# How strictly this verifier compares across layouts is its own setting, not the run's: the trainer
# never reads it, so it is not in the run's config, manifest or identity (docs/verifier.md).
TOLERANCES = flags.DEFINE_string(
    "tolerances", "", "A JSON file written by python -m verifier.calibrate --out for the run's model: its "
    "cross-layout rtols replace the model's own as floors under the measured noise (the from-init pair for a full "
    "proof's first interval). Empty: the model's.")
MEASURE_NOISE = flags.DEFINE_boolean(
    "measure_noise", True, "Across layouts, replay each interval again, perturbed at the rounding level, on this "
    "verifier's own layouts: the spread that bounds a genuine record (docs/verifier.md). Off: a third of the compute, "
    "and every proof across layouts is inconclusive (no bound is established; only the recording layout decides).")


def reverify_steps(text: str, workdir: str) -> tuple[int, ...] | str:
    """--reverify's steps (ledger.ALL for 'all'); ConfigError (exit 2) naming one that is not committed."""
    if text.strip() == ALL:
        return ALL
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):  # an empty item too ("20,,40"): a typo, not a step
        raise ConfigError(f"--reverify={text}: give committed step numbers separated by commas, or all")
    committed = committed_steps(workdir)
    missing = sorted({int(part) for part in parts} - set(committed))
    if missing:
        raise ConfigError(f"--reverify={text}: not committed in {workdir}: {missing} "
                          f"(committed: {committed or 'none'})")
    return tuple(sorted({int(part) for part in parts}))


def check_proving_flags() -> None:
    """Flag values under which a proof would prove nothing are bad input (exit 2), not a vacuous pass."""
    if not math.isfinite(VERIFY_BUDGET.value):
        raise ConfigError(f"--verify_budget={VERIFY_BUDGET.value}: give a finite fraction (0, 0.25, 1, ...)")
    if REPLAY_STEPS.value == 0:
        raise ConfigError("--replay_steps=0 replays nothing, so no step could be proved: give at least 1")


def checked_tolerances(path: str):
    """--tolerances' bounds, refused (ConfigError) where one is not finite or not below 1 (a relative bound
    of the whole value cannot fail)."""
    try:
        measured = tolerances.read_measured(path)
    except ConfigError as err:
        raise ConfigError(f"--tolerances={err}") from None
    for name in ("loss_rtol", "state_rtol", "init_loss_rtol", "init_state_rtol"):
        value = getattr(measured, name, None)
        if value is not None and not (math.isfinite(float(value)) and 0 <= float(value) < 1):
            raise ConfigError(f"--tolerances={path}: its {name} {value} is a bound that cannot fail (a relative "
                              "bound must be finite, at least 0 and below 1)")
    return measured


def _stop_on(signum: int, stop: threading.Event, stopped_by: list[str]) -> None:
    """The first SIGINT or SIGTERM stops the verifier at its next replay chunk; a second Ctrl-C exits at once
    (130): verdicts are written whole or not at all, so nothing is left half-written."""
    name = signal.Signals(signum).name
    if stop.is_set() and name == "SIGINT":
        os.write(2, b"verifier: a second Ctrl-C: exiting at once\n")
        os._exit(exit_codes.INTERRUPTED)
    stopped_by.append(name)
    stop.set()


def main(argv: list[str]) -> int:
    if FOLLOW.value == ONCE.value:
        raise ValueError("give exactly one of --follow and --once")
    check_proving_flags()
    measured = checked_tolerances(TOLERANCES.value) if TOLERANCES.value else None
    distributed.initialize()
    if not WORKDIR.value:
        raise ConfigError("--workdir is required")
    # --once needs the workdir now; --follow may start before the trainer creates it.
    workdir = check_workdir(WORKDIR.value, must_exist=ONCE.value)  # absolute from here on
    mesh = mesh_lib.parse(MESH.value)
    mesh_lib.check_subset(mesh, jax.device_count())  # fewer: the first devices (runtime/mesh.py)
    reverify = reverify_steps(REVERIFY.value, workdir) if REVERIFY.value else ()
    cache_dir = COMPILATION_CACHE_DIR.value  # after the checks: bad input creates nothing
    compile_cache.use(compile_cache.default_dir() if cache_dir is None else cache_dir)
    options = VerifierOptions(workdir=workdir, mesh=mesh, replay_steps=REPLAY_STEPS.value,
                              verify_budget=VERIFY_BUDGET.value, follow=FOLLOW.value,
                              poll_secs=POLL_SECS.value, max_poll_secs=MAX_POLL_SECS.value, tolerances=measured,
                              measure_noise=MEASURE_NOISE.value, reverify=reverify)
    # SIGTERM and SIGINT stop it between replay chunks (verifier/verifier.py): no unfinished verdict is written,
    # and an intact verdict whose replay was cut short is marked interrupted (never shown as replaying).
    stop, stopped_by = threading.Event(), []
    signal.signal(signal.SIGTERM, lambda signum, _: _stop_on(signum, stop, stopped_by))
    signal.signal(signal.SIGINT, lambda signum, _: _stop_on(signum, stop, stopped_by))
    verifier = Verifier(options, stop)
    logging.info("verifier on %d of %d devices, workdir %s", len(mesh_lib.first_devices(mesh) or jax.devices()),
                 jax.device_count(), options.workdir)
    if measured is not None:
        logging.info("cross-layout tolerances from --tolerances=%s", measured.describe())
    if ONCE.value:
        verifier.verify_pending()
    else:
        verifier.follow(stop, until_step=UNTIL_STEP.value)
    if stopped_by and stopped_by[0] == "SIGINT":  # a person's Ctrl-C: what is left says how to finish it
        pending = verifier.pending_steps()
        exit_codes.exit_interrupted(f"verifier stopped by SIGINT: {'steps ' + str(pending) if pending else 'no step'} "
                                    "still to prove; run it again to prove them")
    return exit_code(verifier.ledger, committed_steps(workdir))


def exit_code(ledger, committed: list[int]) -> int:
    """0 only when every committed step is proved; 1 (one `error:` line) when a step failed; UNPROVED (3) when
    none failed but some step is not proved. The last line counts both either way."""
    tally = ledger.tally(committed)
    counts = (f"{len(tally['proved'])} of {len(committed)} committed steps proved, {len(tally['failed'])} failed, "
              f"{len(tally['unproved'])} unproved")
    line = ledger.exit_line(committed)  # evidence first, then the verifier's faults
    if tally["failed"]:
        raise VerificationFailedError(f"{line} ({counts})")
    if tally["unproved"]:
        # The verifier's own faults are in `line` with their causes; the rest by what their verdicts say.
        described = {step: verdicts.describe(ledger.workdir, step) for step in tally["unproved"]}
        others = [f"{step}: {text}" for step, text in described.items()
                  if step not in ledger.unproved and not text.endswith(" error")]
        parts = ([line] if line else []) + ([f"not proved: {', '.join(others)}"] if others else [])
        sys.stderr.write(f"unproved: {'; '.join(parts)} ({counts})\n")
        return exit_codes.UNPROVED
    print(f"verified: {counts}")
    return exit_codes.OK


if __name__ == "__main__":
    entry.run(main)
