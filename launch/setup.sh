#!/usr/bin/env bash
# Creates .venv at the repository root (if missing) and installs the project with the versions
# the test suite ran against (launch/constraints.txt). Safe to run again; sourced by the
# README's two commands and by docker/Dockerfile's install step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$python" -m venv "$root/.venv"
fi
stamp="$root/.venv/.installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$root/launch/constraints.txt" -nt "$stamp" ]; then
  "$root/.venv/bin/python" -m pip install --quiet --upgrade pip
  "$root/.venv/bin/python" -m pip install --quiet -c "$root/launch/constraints.txt" -e "${root}[dev]"
  touch "$stamp"
fi
