"""docker/Dockerfile and its entry point, checked without building the image.

tests/test_image.py builds the image and runs it. These tests are the quick ones: they read the
Dockerfile as Docker would (instructions, line continuations), check it against pyproject.toml,
launch/setup.sh and the ignore file, and run docker/entrypoint.sh itself with this checkout's
Python: every command word must reach a module that imports and parses its flags (slow: one
Python process per command; the rest is plain sh).
"""

import concurrent.futures
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests import helpers

DOCKER_DIR = os.path.join(helpers.REPO_ROOT, "docker")
ENTRYPOINT = os.path.join(DOCKER_DIR, "entrypoint.sh")
# The command words the recipes and the README use, and the modules they must run.
COMMANDS = {"train": "trainer.train", "verify": "verifier.verify", "inspect": "trainer.inspect",
            "local": "launch.local"}


def read(*path: str) -> str:
    with open(os.path.join(helpers.REPO_ROOT, *path)) as f:
        return f.read()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in read("docker", "Dockerfile").splitlines()
                                          if not line.lstrip().startswith("#")))
    result = []
    for line in filter(str.strip, text.splitlines()):
        keyword, _, arguments = line.strip().partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    return result


def of(keyword: str) -> list[str]:
    return [arguments for k, arguments in instructions() if k == keyword]


def test_base_image_is_a_python_the_project_supports():
    [base] = of("FROM")
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", base)
    assert match, base
    minimum = re.search(r'requires-python\s*=\s*">=(\d+)\.(\d+)"', read("pyproject.toml"))
    assert (int(match[1]), int(match[2])) >= (int(minimum[1]), int(minimum[2]))


def test_install_is_the_readme_step_with_the_tested_constraints():
    [install] = of("RUN")[-1:]
    assert "bash launch/setup.sh" in install  # the README's install step, nothing hand-rolled
    setup = read("launch", "setup.sh")
    assert '-c "$root/launch/constraints.txt"' in setup and "pyproject.toml" in setup
    # The TPU extra is the only addition, resolved against the same pinned versions.
    assert re.search(r'pip install .*-c launch/constraints\.txt "jax\[tpu\]"', install)
    assert "JAX_EXTRA=cpu" in of("ARG")
    assert re.search(r"^jax==", read("launch", "constraints.txt"), re.M)


def test_copies_everything_the_install_needs_and_the_ignore_file_lets_it_through():
    copied = [arguments.split()[:-1] for arguments in of("COPY")]
    sources = [source.rstrip("/") for group in copied for source in group]
    for source in sources:
        assert os.path.exists(os.path.join(helpers.REPO_ROOT, source)), source
    # pyproject's package list, its readme, and the files setup.sh reads must all be in the image.
    packages = re.findall(r'"(\w+)\*"', re.search(r"include = \[(.*)\]", read("pyproject.toml"))[1])
    assert set(packages) <= set(sources), packages
    # Every top-level package of the checkout is one that pyproject installs (so the image copies it),
    # the ones that are not the product aside: a new package, say verifier/, cannot be left out.
    top_level = {name for name in os.listdir(helpers.REPO_ROOT)
                 if os.path.isfile(os.path.join(helpers.REPO_ROOT, name, "__init__.py"))}
    assert top_level - {"tests", "examples", "benchmarks"} <= set(packages), sorted(top_level)
    assert {"pyproject.toml", "README.md", "launch", "docker/entrypoint.sh"} <= set(sources)
    # COPY comes before the install step that reads it.
    order = [k for k, _ in instructions()]
    assert max(i for i, k in enumerate(order) if k == "COPY") < max(i for i, k in enumerate(order) if k == "RUN")
    ignore = [line for line in read("docker", "Dockerfile.dockerignore").splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"  # an allow-list: .venv, runs/ and .git never reach the build
    assert {f"!{source}" for source in sources} <= set(ignore)


def test_runs_as_a_non_root_user():
    users = of("USER")
    assert users and users[-1] not in ("root", "0", "0:0")
    order = [k for k, _ in instructions()]
    assert order.index("USER") > max(i for i, k in enumerate(order) if k == "RUN")
    assert any(users[-1] in arguments for arguments in of("RUN"))  # created in the image


def test_entrypoint_names_each_command_and_its_module():
    [entrypoint] = of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["sh", "/app/docker/entrypoint.sh"]
    assert of("WORKDIR") == ["/app"]
    assert json.loads(of("CMD")[-1]) == ["help"]
    named = dict(re.findall(r"^\s*(\w+)\) module=([\w.]+) ;;", read("docker", "entrypoint.sh"), re.M))
    assert named == COMMANDS
    for module in named.values():
        assert importlib.util.find_spec(module) is not None, module


def run_entrypoint(*args: str) -> subprocess.CompletedProcess:
    # `python` in the entry point is this checkout's interpreter, as /app/.venv/bin is in the image.
    env = helpers.subprocess_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(["sh", ENTRYPOINT, *args], env=env, cwd=helpers.REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_every_command_reaches_a_module_that_parses_its_flags():
    # absl's --help exits 1 by design; --only_check_args parses the flags and exits 0 before main.
    with concurrent.futures.ThreadPoolExecutor(len(COMMANDS)) as pool:
        results = dict(zip(COMMANDS, pool.map(lambda word: run_entrypoint(word, "--only_check_args"), COMMANDS)))
    for word, result in results.items():
        assert result.returncode == 0, (word, result.stderr[-2000:])


@pytest.mark.parametrize("args, code, message", [
    (["help"], 0, "train    python -m trainer.train"),
    ([], 2, "error: give a command: train, verify, inspect, local or help"),
    (["trian"], 2, "error: unknown command 'trian'"),
    (["true"], 0, ""),  # a program on PATH runs as is, to debug the image
])
def test_entrypoint_usage_and_bad_commands(args, code, message):
    before = helpers.disk_state(DOCKER_DIR)
    result = run_entrypoint(*args)
    if code:
        helpers.assert_refused(result, before, message)
    else:
        assert result.returncode == code and message in result.stdout
