"""python -m trainer.inspect --workdir=DIR [--losses | --evals] [--plot=run.png|run.svg [--reference=DIR]]

Lists the committed steps of a workdir (size, mesh, processes, time, reason, loss range, the
verifier's verdict); with --losses prints the run's whole loss history (checkpointing/_src/history.py:
every attempt's metrics.jsonl and the committed manifests, whatever retention deleted, the latest
attempt's value of each step) as one JSON object {"<step>": loss}, so a script can compare two
runs; --evals prints the eval numbers the same way ({"<step>": {"eval_loss": ...}}); with --plot
draws the history against the step (each attempt shaded by layout, checkpoints coloured by verdict,
preemptions, crashes, resumes, eval losses; with --reference that run's loss and a second panel of
each step's relative difference to it against the model's tolerance) into that file and prints its
path (checkpointing/_src/plot.py). Apart from that picture it never writes or deletes.
Exit 0; 1 if the storage does not answer within --storage_timeout_secs or
a checkpoint cannot be read; 2 if the workdir is missing or not a directory.
"""

import json
import os
import sys

from absl import flags

from checkpointing.inspection import (PLOT_FORMATS, check_workdir, committed_steps, draw_plot, format_table,
                                      plot_series, plot_title, proof_series, read_history, read_manifest,
                                      reference_loss, table_rows)
from checkpointing.config import is_object_store, resolve_path
from runtime import entry
from trainer import models

WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (local path, gs:// or s3://).")
LOSSES = flags.DEFINE_boolean("losses", False, "Print the run's per-step loss history as JSON instead of the table.")
EVALS = flags.DEFINE_boolean("evals", False, "Print the run's eval numbers per step as JSON instead of the table.")
PLOT = flags.DEFINE_string("plot", None, "Draw the loss against the step into this .png or .svg file (local, gs:// or s3://).")
REFERENCE = flags.DEFINE_string("reference", None, "With --plot: also draw this workdir's loss (a reference run).")


def _check_plot_flags() -> None:
    """Bad --plot/--reference input, before anything is read or written."""
    if LOSSES.value and EVALS.value:
        raise ValueError("--losses and --evals are exclusive")
    if REFERENCE.value and not PLOT.value:
        raise ValueError("--reference needs --plot")
    if PLOT.value is None:
        return
    if not PLOT.value.lower().endswith(PLOT_FORMATS):
        raise ValueError(f"--plot={PLOT.value}: the file must end in {' or '.join(PLOT_FORMATS)}")
    if LOSSES.value or EVALS.value:
        raise ValueError(f"--plot and --{'losses' if LOSSES.value else 'evals'} are exclusive")
    if not is_object_store(PLOT.value):
        parent = os.path.dirname(os.path.abspath(PLOT.value))
        if not os.path.isdir(parent):
            raise ValueError(f"--plot={PLOT.value}: directory {parent} does not exist")
        if os.path.isdir(PLOT.value):
            raise ValueError(f"--plot={PLOT.value} is a directory")
    if REFERENCE.value:
        check_workdir(REFERENCE.value, must_exist=True, flag="--reference")


def loss_tolerance(workdir: str) -> float:
    """The model's cross-layout loss tolerance (its spec's cross_mesh_loss_rtol), read from the newest
    committed manifest's config; 0 where the model cannot be resolved here (then no tolerance line)."""
    steps = committed_steps(workdir)
    if not steps:
        return 0.0
    try:
        return models.resolve(read_manifest(workdir, steps[-1])["config"]["model"]).cross_mesh_loss_rtol
    except (ValueError, KeyError, ImportError):
        return 0.0


def _plot(workdir: str) -> str:
    run = plot_series(workdir)
    reference = reference_loss(resolve_path(REFERENCE.value, "--reference")) if REFERENCE.value else None
    proof = proof_series(run, reference, loss_tolerance(workdir)) if reference else None
    title = plot_title(workdir, run) + (" (grey: the reference run's loss)" if reference else "")
    draw_plot(run, PLOT.value, title=title, reference=reference, proof=proof)
    return PLOT.value


def main(argv: list[str]) -> None:
    if not WORKDIR.value:
        raise ValueError("--workdir is required")
    workdir = check_workdir(WORKDIR.value, must_exist=True)  # absolute from here on
    _check_plot_flags()
    if PLOT.value:
        output = _plot(workdir)
    elif LOSSES.value or EVALS.value:
        history = read_history(workdir)
        output = json.dumps({str(s): v for s, v in (history.losses if LOSSES.value else history.evals).items()})
    else:
        output = format_table(table_rows(workdir))
    sys.stdout.write(output + "\n")


if __name__ == "__main__":
    entry.run(main)
