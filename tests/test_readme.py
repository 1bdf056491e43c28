"""Every command of README.md's ```bash blocks, run verbatim in a fresh checkout (issue 58).

A module fixture clones the committed HEAD into a temporary directory and runs the README's set-up
block there as written (`bash launch/setup.sh` makes the clone's own .venv; pip uses its cache).
Each later command then runs in `bash -c` in that checkout, the set-up lines before it, from an
environment without this suite's XLA_FLAGS, JAX_PLATFORMS, PYTHONPATH or virtualenv, in README
order, and must exit with the code the README documents for it (0: done; the verifier's `--once` 0:
every step proved). `DIR` is a fresh directory per training command (`trainer.train`,
`examples.own_loop`); a later command reads the one the training command before it made. A command
this module does not know how to run fails its test, never skipped (docs_text.py: what a command is).
docs/*.md's ```bash commands are not run here (Cloud TPU, GKE, Slurm, podman, the full benchmarks);
tests/test_docs.py checks each flag they give against the command's `--helpfull`.
"""

import glob
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from runtime import exit_codes
from tests import docs_text, helpers

pytestmark = pytest.mark.slow

README = docs_text.ROOT / "README.md"
SET_UP_HEADING = "## Install"  # its ```bash block: the set-up lines, run before every command
TRAINERS = ("trainer.train", "examples.own_loop")  # their DIR is a fresh directory
NOT_RUN = {"bash tests/run.sh": "the whole suite, this module among them: run here it would run itself"}
# Templates: `[--flag=value]` is optional, `a|b` alternatives. Both templates of the README are run
# with their brackets dropped (the defaults): the trainer trains the default mlp for its default 100
# steps, inspect reads that run. Their bracketed flags are checked against `--helpfull` by
# tests/test_docs.py (test_every_documented_command_prints_its_help_with_every_flag_the_docs_give_it).
OPTIONAL = re.compile(r"\s*\[[^\]]*\]")
DEFAULT_STEPS = 100  # trainer.config.TrainConfig.steps and examples/own_loop.py's --steps
TIMEOUT_SECS = 540  # under pyproject's 600 s per test
WITHOUT = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")  # the suite's own


def set_up_lines() -> list[str]:
    lines = README.read_text().splitlines()
    start = lines.index(SET_UP_HEADING)
    blocks = docs_text.fenced_blocks(lines, "bash", start + 1, section_only=True)
    assert len(blocks) == 1, f"README.md: {SET_UP_HEADING} has {len(blocks)} ```bash blocks, expected one"
    return docs_text.shell_commands(blocks[0][1])


SET_UP = set_up_lines()
FAKE_DEVICES = int(re.search(r"device_count=(\d+)", " ".join(SET_UP)).group(1))
COMMANDS = [(number, line) for number, line in docs_text.readme_commands() if line not in SET_UP]


def documented_result_prefix() -> str:
    """The demo's RESULT line as the README shows it, up to the numbers: `RESULT: the resumed ... run's`."""
    [line] = [line for line in README.read_text().splitlines() if line.startswith("RESULT: ")]
    return ":".join(line.split(":")[:2])


def user_environment() -> dict[str, str]:
    """This process's environment less what the suite set for itself: a user's shell before the set-up."""
    env = {name: value for name, value in os.environ.items() if name not in WITHOUT}
    env["PATH"] = os.pathsep.join(entry for entry in env.get("PATH", "").split(os.pathsep)
                                  if not entry.startswith(helpers.REPO_ROOT))
    return env


def run_after_set_up(checkout, command: str, timeout: float = TIMEOUT_SECS) -> subprocess.CompletedProcess:
    """`command` in `bash -c` in the checkout after the set-up lines (which must succeed); the whole
    process group killed if it runs past `timeout`."""
    script = "\n".join(["set -e", *SET_UP, "set +e", command])
    proc = subprocess.Popen(["bash", "-c", script], cwd=checkout, env=user_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"`{command}` ran past {timeout:.0f}s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """{"path": a clone of the committed HEAD with the README's set-up run, "tmp": where DIRs go,
    "dir": the DIR of the latest training command}."""
    tmp = tmp_path_factory.mktemp("readme")
    path = tmp / "checkout"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=helpers.REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", helpers.REPO_ROOT, str(path)], check=True, timeout=120)
    subprocess.run(["git", "checkout", "--quiet", "--detach", head], cwd=path, check=True, timeout=60)
    started = time.monotonic()
    result = run_after_set_up(path, "true")
    assert result.returncode == 0, f"the README's set-up failed in a fresh clone:\n{result.stderr[-4000:]}"
    print(f"\nREADME set-up in a fresh clone: {time.monotonic() - started:.0f}s")
    return {"path": path, "tmp": tmp, "dir": None}


def as_run(line: str, state: dict) -> str:
    """The command that runs for README `line`: templates' brackets dropped, DIR a directory. Fails
    the test for a command this module does not know how to run."""
    command = OPTIONAL.sub("", line)
    parts = [part.strip() for part in command.split("&&")]
    if command != "bash launch/demo.sh" and not all(part.startswith("python -m ") for part in parts):
        pytest.fail(f"README.md: `{line}`: not a `python -m` command or a known script; teach tests/test_readme.py "
                    "how to run it and what it must exit with")
    if re.search(r"[|\[\]]", re.sub(r"'[^']*'", "", command)):  # outside quotes
        pytest.fail(f"README.md: `{line}`: a template this module cannot run with its brackets dropped")
    if "DIR" in command:
        if parts[0].split()[2] in TRAINERS:
            state["dir"] = str(state["tmp"] / f"dir{len(list(state['tmp'].glob('dir*')))}")
        assert state["dir"], f"`{line}` reads DIR before any training command of the README made one"
        command = re.sub(r"\bDIR\b", state["dir"], command)
    return command


def flag(part: str, name: str, default=None):
    found = re.search(rf"--{name}=(\S+)", part)
    return found.group(1).strip("'") if found else default


def check_outcome(command: str, result: subprocess.CompletedProcess, checkout) -> None:
    """What each command's success means beyond its exit code: the run trained to its last step, the
    verifier left a verdict for every committed step, the demo printed the README's RESULT."""
    from checkpointing._src.workdir import committed_steps

    if command == "bash launch/demo.sh":
        results = [line for line in result.stdout.splitlines() if line.startswith("RESULT: ")]
        assert results and results[-1].startswith(documented_result_prefix()), result.stdout[-3000:]
        return
    for part in command.split("&&"):
        words = part.split()
        workdir = flag(part, "workdir")
        workdir = workdir and os.path.join(checkout, workdir)
        if words[2] in TRAINERS:
            steps = committed_steps(workdir)
            assert steps and steps[-1] == int(flag(part, "steps", DEFAULT_STEPS)), (part, steps)
        elif words[2] == "verifier.verify":
            mesh = flag(part, "mesh")  # README: on the first that many of the devices the set-up fakes
            if mesh:
                used = int(np.prod([int(size) for size in re.findall(r"=(\d+)", mesh)]))
                assert f"verifier on {used} of {FAKE_DEVICES} devices" in result.stderr, result.stderr[-3000:]
            verdicts = sorted(int(name.split(".")[0]) for name in os.listdir(os.path.join(workdir, "verdicts")))
            assert verdicts == committed_steps(workdir), (part, verdicts)
        elif words[2] == "trainer.prepare":
            assert glob.glob(os.path.join(checkout, flag(part, "out_dir"), "train-*.array_record")), part


def test_the_readme_has_a_set_up_block_and_only_bash_blocks_of_commands():
    assert SET_UP[0] == "bash launch/setup.sh" and "source .venv/bin/activate" in SET_UP, SET_UP
    assert any(line.startswith("export XLA_FLAGS=") for line in SET_UP), SET_UP
    other = set(docs_text.fence_languages(README)) - {"bash", "python", ""}
    assert not other, f"README.md has ```{other} blocks: commands go in ```bash blocks, which this module runs"
    assert len(COMMANDS) >= 8, COMMANDS


def command_id(number: int, line: str) -> str:
    words = line.split()
    return f"line{number}-{words[2] if words[:2] == ['python', '-m'] else words[-1]}"


@pytest.mark.parametrize("number, line", COMMANDS, ids=[command_id(*command) for command in COMMANDS])
def test_a_readme_command_runs_verbatim_after_the_set_up(number, line, checkout):
    if line in NOT_RUN:
        # not run: NOT_RUN says why; it must still be the command the README gives
        assert os.path.exists(os.path.join(checkout["path"], line.split()[1])), line
        return
    command = as_run(line, checkout)
    started = time.monotonic()
    result = run_after_set_up(checkout["path"], command)
    print(f"\nREADME.md:{number} `{command}`: exit {result.returncode} in {time.monotonic() - started:.0f}s")
    assert result.returncode == exit_codes.OK, \
        f"README.md:{number} `{line}` exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    check_outcome(command, result, str(checkout["path"]))
