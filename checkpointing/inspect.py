"""python -m checkpointing.inspect --workdir=DIR [--losses]

Lists the committed steps of a workdir (size, mesh, processes, time, reason, loss range, the
verifier's verdict); with --losses prints every recorded per-step loss of every committed
checkpoint as one JSON object {"<step>": loss}, so a script can compare two runs. Read-only: it
never writes or deletes.
"""

import json
import sys

from absl import app, flags

from checkpointing.errors import CheckpointError
from checkpointing.report import format_table, recorded_losses, table_rows
from launch import exit_codes, logs

WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (local path or gs://).")
LOSSES = flags.DEFINE_boolean("losses", False, "Print the recorded per-step losses as JSON instead of the table.")


def main(argv: list[str]) -> None:
    logs.quiet_library_logs()
    if not WORKDIR.value:
        exit_codes.exit_bad_input(ValueError("--workdir is required"))
    try:
        if LOSSES.value:
            output = json.dumps({str(s): v for s, v in recorded_losses(WORKDIR.value).items()})
        else:
            output = format_table(table_rows(WORKDIR.value))
    except CheckpointError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(exit_codes.FAILURE)
    sys.stdout.write(output + "\n")


if __name__ == "__main__":
    app.run(main, flags_parser=exit_codes.parse_flags_or_exit)
