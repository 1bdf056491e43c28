"""Exit codes shared by the trainer, the verifier and every launcher.

A scheduler's restart policy keys on these: PREEMPTED means "the state is saved, requeue me";
FAILURE means something broke and a blind restart may loop; BAD_INPUT means a person must
change the command (nothing was deleted, overwritten or partially restored).
"""

import sys

from absl import flags

OK = 0
FAILURE = 1  # a crash, a failed verdict (verifier), a dead or stuck peer, a save that missed its deadline
BAD_INPUT = 2  # bad flags, a checkpoint that does not match the program, an unusable workdir
UNPROVED = 3  # the verifier: no step failed, but some step it judged is not proved (intact only, inconclusive, error)
PREEMPTED = 75  # EX_TEMPFAIL: preempted, the final checkpoint committed, requeue me
INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl-C exited at once (a save in flight never committed); the
# verifier stopped by Ctrl-C (its pending steps are proved by its next run)


class Fault(Exception):
    """A fault of the storage or the run (not of the command): one `error:` line, exit FAILURE.
    checkpointing's errors derive from it; a ValueError among them is bad input instead."""


class Preempted(SystemExit):
    """The run was preempted at `step` and that step's checkpoint committed: exit PREEMPTED.

    A SystemExit, so a user's own loop that does not catch it exits 75 without a traceback, and an
    `except Exception` on the way out does not swallow the requeue."""

    def __init__(self, step: int, message: str | None = None):
        super().__init__(PREEMPTED)
        self.message = message or f"preempted at step {step}; its checkpoint committed"
        self.step = step

    def __str__(self) -> str:
        return self.message


def exit_bad_input(error: Exception) -> None:
    """One line on stderr naming what is wrong, then exit BAD_INPUT."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()
    sys.exit(BAD_INPUT)


def exit_interrupted(line: str) -> None:
    """A process a person stopped with Ctrl-C: one line on stderr, then exit INTERRUPTED (no traceback)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
    sys.exit(INTERRUPTED)


HELP_FLAGS = ("help", "?", "helpshort", "helpfull", "helpxml")  # absl's own, each printing and exiting 1


def asks_for_help(argv: list[str]) -> bool:
    """Whether the command line holds one of absl's help flags (before a `--` that ends the flags)."""
    for arg in argv[1:]:
        if arg == "--":
            return False
        name, _, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in HELP_FLAGS and value.lower() not in ("false", "0"):
            return True
    return False


def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """absl's flag parser for app.run, but a bad flag exits BAD_INPUT with one line (absl's own is 1),
    and asking for help (--help, --helpfull, ...) is a success: exit OK (absl's own is 1)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        exit_bad_input(err)
    except SystemExit as exit_:
        if exit_.code == 1 and asks_for_help(argv):
            sys.stdout.flush()
            sys.exit(OK)
        raise
