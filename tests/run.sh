#!/usr/bin/env bash
# The README's test command: sets up .venv (launch/setup.sh) and runs the whole suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -m "not slow"` (the fast tier, about a
# minute on 2 idle cores, up to 90 s on busy ones) or `bash tests/run.sh -k kill -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
