"""`run(main)`: the one exit-code mapping every entry point runs under (runtime/exit_codes.py).

    bad flags, unexpected arguments, ValueError (ConfigError, BadCheckpointRequest) -> 2, one line
    Preempted (its checkpoint committed, or deliberately not started)                -> 75
    Fault (CheckpointError), OSError (the disk or the storage itself)               -> 1, one line
A `main` returns an exit code (None is 0) or raises; it never maps an error itself. Imports no JAX:
the trainer holds SIGTERM before importing it (runtime/distributed.py).
"""

import sys
from typing import Callable

from absl import app, logging

from runtime import exit_codes, logs
from runtime.causes import one_line_cause


def exit_code_of(main: Callable[[list[str]], int | None], argv: list[str], *, takes_arguments: bool = False) -> int:
    """Runs main(argv) and maps what it raises; SystemExit (a deliberate exit) passes through.

    Positional arguments are bad input unless `takes_arguments` (a launcher passing on a command).
    """
    logs.quiet_library_logs()
    try:
        if len(argv) > 1 and not takes_arguments:
            raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
        return main(argv) or exit_codes.OK
    except exit_codes.Preempted as preempted:
        logging.warning("%s: exiting with %d so the scheduler requeues the job", preempted, exit_codes.PREEMPTED)
        return exit_codes.PREEMPTED
    except ValueError as err:  # ConfigError, and checkpointing's BadCheckpointRequest
        exit_codes.exit_bad_input(err)
    except exit_codes.Fault as err:  # checkpointing's CheckpointError
        logs.exit_failure(str(err), err)
    except OSError as err:
        logs.exit_failure(f"{err.filename or 'storage'}: {one_line_cause(err)}", err)


def run(main: Callable[[list[str]], int | None], *, takes_arguments: bool = False) -> None:
    """absl's app.run under the mapping above; a bad flag is exit 2 with one line (absl's own is 1)."""
    app.run(lambda argv: sys.exit(exit_code_of(main, argv, takes_arguments=takes_arguments)),
            flags_parser=exit_codes.parse_flags_or_exit)
