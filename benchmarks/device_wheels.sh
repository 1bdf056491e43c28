#!/usr/bin/env bash
# Downloads into .whl-tpu/ the wheels benchmarks/device_run.sh installs on a device machine: this project's
# runtime packages at the versions launch/constraints.txt pins, for that machine's Python (3.11, x86-64),
# less what the machine has (JAX, jaxlib, numpy, scipy, ml_dtypes, opt_einsum) and what the benchmark never
# imports (matplotlib's plots, the GCS client). Under 40 MiB: a device call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
names=(absl-py aiofiles array_record cloudpickle etils flax fsspec grain humanize markdown-it-py mdurl msgpack
       optax orbax-checkpoint packaging portpicker prometheus_client protobuf psutil Pygments python-dateutil
       PyYAML rich sentencepiece simplejson tensorboardX tensorstore treescope typing_extensions tzdata uvloop zipp)
pins=()
for name in "${names[@]}"; do
  pin=$(grep -i -E "^${name}==" launch/constraints.txt || true)
  [[ -n "$pin" ]] || { echo "device_wheels.sh: $name is not pinned in launch/constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 \
           manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  "${platforms[@]}" -d .whl-tpu "${pins[@]}"
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo /.whl-tpu/ >> .git/info/exclude
du -sh .whl-tpu
