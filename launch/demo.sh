#!/usr/bin/env bash
# The README's main command: sets up .venv (launch/setup.sh), then runs the demo
# (launch/demo.py): a local pod trains, is preempted, resumes on another layout and is verified.
# Extra arguments go to launch.demo, e.g. `bash launch/demo.sh --model=transformer`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative DEMO_WORKDIR names a directory under the caller's, not the repository's.
workdir="${DEMO_WORKDIR:-$root/runs/demo-$(date +%Y%m%d-%H%M%S)}"
case "$workdir" in /* | *://*) ;; *) workdir="$PWD/$workdir" ;; esac
bash "$root/launch/setup.sh"
cd "$root"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/python -m launch.demo --workdir="$workdir" "$@"
