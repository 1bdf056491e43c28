#!/usr/bin/env bash
# Where the service's cost goes on the chip (issue 57): steps/s of plain Orbax and the service with a save every
# EVERY steps and no per-step sync (--log_every_steps=100), each one's restart (STEPS + 5, warm cache: the phase
# lines and the `open parts:` line), then a cProfile of the service's run. Results under $OUT:
#   plain.log, service.log, plain_restart.log, service_restart.log, service.prof (pstats), prof.log
#   bash benchmarks/chip_diag.sh    # on a device machine, with .whl-tpu/ (benchmarks/device_wheels.sh); STEPS, EVERY
# PROFILE=0 leaves out the profiled run.
set -euo pipefail
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl-tpu/*.whl
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
M=(--model=transformer --hidden_dim=1024 --num_layers=8 --num_heads=8 --seq_len=256 --vocab_size=8192 --batch_size=16)
S=(--mesh=data=1 --save_every_steps="${EVERY:-20}" --log_every_steps=100)
STEPS=${STEPS:-240}
module() { if [[ $1 == plain ]]; then echo benchmarks.plain_orbax_trainer; else echo trainer.train; fi; }
for v in plain service; do
  rm -rf /tmp/w_$v
  timeout 200 python3 -m "$(module $v)" --workdir="/tmp/w_$v" --steps="$STEPS" "${S[@]}" "${M[@]}" > "$OUT/$v.log" 2>&1
  echo "$v: $(grep -h "done:" "$OUT/$v.log" | sed 's/.*\] //')"
done
echo "service commits (s, save() to commit): $(grep -h -o "committed in [0-9.]*" "$OUT/service.log" | awk '{print $3}' | tr '\n' ' ')"
echo "service hand-offs: $(grep -h -o "next save waited [0-9.]*" "$OUT/service.log" | awk '{print $4}' | tr '\n' ' ')"
for v in plain service; do
  timeout 120 python3 -m "$(module $v)" --workdir="/tmp/w_$v" --steps=$((STEPS + 5)) "${S[@]}" "${M[@]}" > "$OUT/${v}_restart.log" 2>&1
  echo "$v restart: $(grep -h -E "phase (open|compile|restore|first_step) " "$OUT/${v}_restart.log" \
    | sed 's/.*phase //' | tr '\n' ' ')"
  grep -h "open parts:" "$OUT/${v}_restart.log" | sed 's/.*\] /  /'
done
[[ ${PROFILE:-1} == 1 ]] || exit 0
rm -rf /tmp/w_prof
timeout 200 python3 -m cProfile -o "$OUT/service.prof" -m trainer.train --workdir=/tmp/w_prof --steps="$STEPS" "${S[@]}" "${M[@]}" \
  > "$OUT/prof.log" 2>&1
echo "service, profiled: $(grep -h "done:" "$OUT/prof.log" | sed 's/.*\] //')"
