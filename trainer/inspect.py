"""python -m trainer.inspect --workdir=DIR [--losses] [--plot=run.png|run.svg [--reference=DIR]]

Lists the committed steps of a workdir (size, mesh, processes, time, reason, loss range, the
verifier's verdict); with --losses prints every recorded per-step loss of every committed
checkpoint as one JSON object {"<step>": loss}, so a script can compare two runs; with --plot
draws the loss against the step (checkpoints coloured by verdict, preemptions, resumes with their
mesh, and --reference's loss) into that file and prints its path (checkpointing/plot.py). Apart
from that picture it never writes or deletes. Exit 0; 1 if the storage does not answer within --storage_timeout_secs or
a checkpoint cannot be read; 2 if the workdir is missing or not a directory.
"""

import json
import os
import sys

from absl import flags

from checkpointing import (PLOT_FORMATS, check_workdir, draw_plot, format_table, plot_series, recorded_losses,
                           reference_loss, table_rows)
from runtime import entry

WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (local path or gs://).")
LOSSES = flags.DEFINE_boolean("losses", False, "Print the recorded per-step losses as JSON instead of the table.")
PLOT = flags.DEFINE_string("plot", None, "Draw the loss against the step into this .png or .svg file (local or gs://).")
REFERENCE = flags.DEFINE_string("reference", None, "With --plot: also draw this workdir's loss (a reference run).")


def _check_plot_flags() -> None:
    """Bad --plot/--reference input, before anything is read or written."""
    if REFERENCE.value and not PLOT.value:
        raise ValueError("--reference needs --plot")
    if PLOT.value is None:
        return
    if not PLOT.value.lower().endswith(PLOT_FORMATS):
        raise ValueError(f"--plot={PLOT.value}: the file must end in {' or '.join(PLOT_FORMATS)}")
    if LOSSES.value:
        raise ValueError("--plot and --losses are exclusive")
    if not PLOT.value.startswith("gs://"):
        parent = os.path.dirname(os.path.abspath(PLOT.value))
        if not os.path.isdir(parent):
            raise ValueError(f"--plot={PLOT.value}: directory {parent} does not exist")
        if os.path.isdir(PLOT.value):
            raise ValueError(f"--plot={PLOT.value} is a directory")
    if REFERENCE.value:
        check_workdir(REFERENCE.value, must_exist=True)


def _plot() -> str:
    reference = reference_loss(REFERENCE.value) if REFERENCE.value else None
    draw_plot(plot_series(WORKDIR.value), PLOT.value, title=WORKDIR.value, reference=reference)
    return PLOT.value


def main(argv: list[str]) -> None:
    if not WORKDIR.value:
        raise ValueError("--workdir is required")
    check_workdir(WORKDIR.value, must_exist=True)
    _check_plot_flags()
    if PLOT.value:
        output = _plot()
    elif LOSSES.value:
        output = json.dumps({str(s): v for s, v in recorded_losses(WORKDIR.value).items()})
    else:
        output = format_table(table_rows(WORKDIR.value))
    sys.stdout.write(output + "\n")


if __name__ == "__main__":
    entry.run(main)
