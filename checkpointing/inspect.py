"""python -m checkpointing.inspect --workdir=DIR [--losses]

Lists the committed steps of a workdir (size, mesh, processes, time, reason, loss range, the
verifier's verdict); with
--losses prints every recorded per-step loss of every committed checkpoint as one JSON object
{"<step>": loss}, so a script can compare two runs. Read-only: it never writes or deletes.
"""

import json
import sys

from absl import app, flags

from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing.errors import CheckpointError
from checkpointing.service import committed_steps, read_manifest, step_path
from launch import exit_codes, logs

WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (local path or gs://).")
LOSSES = flags.DEFINE_boolean("losses", False, "Print the recorded per-step losses as JSON instead of the table.")


def directory_bytes(path) -> int:
    """Total size of the files under `path` (epath refuses '**' globs, so walk it)."""
    total = 0
    for child in path.iterdir():
        total += directory_bytes(child) if child.is_dir() else child.stat().length
    return total


def recorded_losses(workdir: str) -> dict[int, float]:
    """Every per-step loss recorded by the committed checkpoints of `workdir`."""
    losses = {}
    for step in committed_steps(workdir):
        losses.update(manifest_lib.losses(read_manifest(workdir, step)))
    return dict(sorted(losses.items()))


def table_rows(workdir: str) -> list[dict]:
    rows = []
    for step in committed_steps(workdir):
        manifest = read_manifest(workdir, step)
        losses = list(manifest_lib.losses(manifest).values())
        rows.append({
            "step": step,
            "bytes": directory_bytes(step_path(workdir, step)),
            "mesh": ",".join(f"{axis}={size}" for axis, size in manifest["mesh"].items()),
            "processes": manifest["process_count"],
            "saved_at": manifest["saved_at"],
            "reason": manifest["reason"],
            "losses": f"{min(losses):.6g}..{max(losses):.6g} ({len(losses)} steps)" if losses else "-",
            "verdict": verdicts.summary(verdicts.read(workdir, step)),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "no committed checkpoints"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines)


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
