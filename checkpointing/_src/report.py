"""What a workdir holds, for people and scripts: committed steps, their losses and verdicts."""

from checkpointing.config import format_mesh
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import platform_record
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps, read_manifest
from checkpointing._src.workdir import fresh_path


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
    """One row per committed step, the values as a script wants them (`bytes` an int, `saved_at` ISO-8601);
    format_table makes them fit a terminal."""
    rows = []
    for step in committed_steps(workdir):
        manifest = read_manifest(workdir, step)
        losses = list(manifest_lib.losses(manifest).values())
        rows.append({
            "step": step,
            "bytes": directory_bytes(fresh_path(str(workdir_lib.step_dir(workdir, step)))),
            "mesh": format_mesh(manifest["mesh"]),
            "processes": manifest["process_count"],
            "platform": platform_record.describe(manifest.get("platform")),  # '-': saved before it was recorded
            "saved_at": manifest["saved_at"],
            "reason": manifest["reason"],
            "resumed_from": _resumed_from(manifest),
            "losses": f"{min(losses):.4g}..{max(losses):.4g} ({len(losses)})" if losses else "-",
            "verdict": verdicts.describe(workdir, step),
        })
    return rows


def _resumed_from(manifest: dict) -> str:
    """'35 (local)': the step and tier the run that saved this step resumed from; '-' for a fresh run."""
    resumed = (manifest.get("extra") or {}).get("resumed_from")
    return f"{resumed['step']} ({resumed['tier']})" if resumed else "-"


def human_bytes(count: int) -> str:
    """'121.5 KiB': a size as a person reads it (binary units, as du -h)."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def _resumed(value: str) -> str:
    """'161' for a resume from the persistent tier (the usual one), '75 (local)' from a host's local tier."""
    return value.removesuffix(" (persistent)")


# (row key, header, how a value is shown): the table a person reads, within WIDTH columns for a run such as
# the demo's (README); table_rows keeps the raw values for scripts.
_COLUMNS = (("step", "step", str), ("bytes", "size", human_bytes), ("mesh", "mesh", str),
            ("processes", "procs", str), ("platform", "platform", str), ("saved_at", "saved (UTC)", None),
            ("reason", "reason", str), ("resumed_from", "resumed from", _resumed), ("losses", "losses (steps)", str),
            ("verdict", "verdict", str))
WIDTH = 120


def format_table(rows: list[dict]) -> str:
    """The rows as a table a terminal of WIDTH columns holds: sizes human-readable; what every row shares (the
    platform, the process count, the day) said once in a line above it; the process count, where it changes,
    beside the mesh; the time to the minute."""
    if not rows:
        return "no committed checkpoints"
    shared = [f"{key} {rows[0][key]}" for key in ("processes", "platform") if len({str(r[key]) for r in rows}) == 1]
    days = {str(row["saved_at"])[:10] for row in rows}
    if len(days) == 1:
        shared.append(f"saved on {days.pop()} (UTC)")
    one_day = len(shared) and shared[-1].startswith("saved on")

    def saved(iso: str) -> str:  # '2026-12-07T08:59:26+00:00' -> '08:59' (one day) or '12-07 08:59'
        return iso[11:16] if one_day else iso[5:16].replace("T", " ")

    columns = []
    for key, header, show in _COLUMNS:
        if key == "processes" or (key == "platform" and f"platform {rows[0]['platform']}" in shared):
            continue
        if key == "mesh" and not any(item.startswith("processes ") for item in shared):
            header, show = "mesh (procs)", None
        if key == "saved_at" and one_day:
            header = "saved"
        columns.append((key, header, show))
    cells = [[saved(row[key]) if key == "saved_at" else f"{row['mesh']} ({row['processes']})" if show is None
              else show(row[key]) for key, _, show in columns] for row in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, (_, header, _) in enumerate(columns)]
    lines = ["every step: " + ", ".join(shared)] if shared else []
    lines.append("  ".join(header.ljust(width) for (_, header, _), width in zip(columns, widths)).rstrip())
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
