#!/usr/bin/env bash
# The README's main command: sets up .venv (launch/setup.sh), then runs the demo job.
# Extra arguments go to the trainer, e.g. `bash launch/demo.sh --model=transformer`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup.sh"
cd "$root"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
workdir="${DEMO_WORKDIR:-$root/runs/demo-$(date +%Y%m%d-%H%M%S)}"
exec .venv/bin/python -m trainer.train --workdir="$workdir" --mesh=data=4,model=2 --steps=100 "$@"
