#!/usr/bin/env bash
# The device benchmark on a machine with an accelerator, set-up included (docs/performance.md, "TPU"):
#
#   bash benchmarks/device_run.sh [device_bench flags, e.g. --parts=checkpoint,verifier]
#   bash benchmarks/device_run.sh tests        # the tests that need the chip (tests/test_on_chip.py)
#
# Such a machine has JAX and libtpu but not this project's other packages, and no network: they travel as
# wheels in .whl-tpu/ (made here by benchmarks/device_wheels.sh) and are installed under /tmp/site, after
# the machine's own JAX on PYTHONPATH. The report and the JSON go to $OUT (else ./device-bench-out).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -d .whl-tpu ]]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
if [[ "${1:-}" == tests ]]; then
  shift
  CHIP_TESTS=1 exec python3 -m pytest -m chip tests/test_on_chip.py "$@"
fi
out="${OUT:-$PWD/device-bench-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m benchmarks.device_bench --json_out="$out/device_bench.json" "$@" 2>"$out/device_bench.log" \
  | tee "$out/device_bench.md"
