"""What the verifier benchmark reads of a run's workdir while it runs: when each commit, first verdict and
complete verdict appeared (benchmarks/verifier_bench.py polls), and, when a run ends with a step unproved,
which steps and why, with the run's logs, verdicts and probes kept for a look."""

import json
import os
import re
import shutil
import tempfile
import time

from checkpointing._src.workdir import probe_file, verdict_file


def scan(step_dir: str, verdict_dir: str, commits: dict, verdicts: dict, complete: dict) -> None:
    """Records when each step directory, its first verdict and its complete verdict are first seen."""
    now = time.perf_counter()
    for name in os.listdir(step_dir) if os.path.isdir(step_dir) else ():
        if name.isdigit():
            commits.setdefault(int(name), now)
    for name in os.listdir(verdict_dir) if os.path.isdir(verdict_dir) else ():
        match = re.fullmatch(r"(\d+)\.json", name)
        if match and int(match[1]) not in complete:
            with open(os.path.join(verdict_dir, name)) as f:
                verdict = json.load(f)  # written atomically: whole or not there
            verdicts.setdefault(int(match[1]), (now, verdict))
            if verdict["complete"]:
                complete[int(match[1])] = (now, verdict)


def unproved(commits: dict, verdicts: dict, complete: dict) -> list[str]:
    """One line per committed step without a passing complete verdict, naming what it has instead."""
    problems = []
    for step in sorted(commits):
        if step in complete and complete[step][1]["status"] != "pass":
            verdict = complete[step][1]
            problems.append(f"step {step}: {verdict['level']} {verdict['status']}: {verdict['detail']}")
        elif step not in complete:
            first = verdicts.get(step, (None, None))[1]
            problems.append(f"step {step}: no complete verdict (first verdict: "
                            f"{'none' if first is None else first['level'] + ' ' + first['status']})")
    return problems


def keep_for_diagnosis(run_dir: str, ckpt: str, parent: str) -> str:
    """Copies a failed run's logs, verdicts and probes (not its checkpoints) out of the benchmark's temp dir,
    which is deleted at the end, into a new dir under `parent`; returns where."""
    kept = tempfile.mkdtemp(prefix="verifier_bench_failed_", dir=parent)
    for name in os.listdir(run_dir):
        if name.endswith(".log"):
            shutil.copy(os.path.join(run_dir, name), kept)
    for folder in (verdict_file(ckpt, 0).parent, probe_file(ckpt, 0).parent):
        if os.path.isdir(folder):
            shutil.copytree(folder, os.path.join(kept, folder.name))
    return kept
