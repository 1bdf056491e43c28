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
            "losses": f"{min(losses):.6g}..{max(losses):.6g} ({len(losses)} steps)" if losses else "-",
            "verdict": verdicts.describe(workdir, step),
        })
    return rows


def _resumed_from(manifest: dict) -> str:
    """'35 (local)': the step and tier the run that saved this step resumed from; '-' for a fresh run."""
    resumed = (manifest.get("extra") or {}).get("resumed_from")
    return f"{resumed['step']} ({resumed['tier']})" if resumed else "-"


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "no committed checkpoints"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines)
