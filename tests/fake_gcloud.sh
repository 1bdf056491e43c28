#!/usr/bin/env bash
# A fake gcloud for tests/test_recipes_tpu.py: logs each argument list (bash-quoted, one call a
# line) to $FAKE_GCLOUD_DIR/argv and answers from files there, so run.sh's loop runs as written.
#   state      the TPU's state word (absent: no TPU)
#   trainer    one line per trainer run: its exit code, then optionally the TPU state it leaves
#   verifier   the verifier's exit code;  vm: present once the verifier VM exists
d="$FAKE_GCLOUD_DIR"
printf -v line '%q ' "$@"
echo "$line" >> "$d/argv"
case "$1 $2 $3 $4" in
  "compute tpus tpu-vm list" | "compute tpus queued-resources list") cat "$d/state" 2>/dev/null; exit 0 ;;
  "compute tpus tpu-vm create") echo READY > "$d/state"; exit 0 ;;
  "compute tpus queued-resources create") echo ACTIVE > "$d/state"; exit 0 ;;
  "compute tpus tpu-vm delete" | "compute tpus queued-resources delete") rm -f "$d/state"; exit 0 ;;
  "compute tpus tpu-vm ssh")
    case "$*" in *TPU_WORKER_HOSTNAMES*) ;; *) exit 0 ;; esac
    read -r code state < <(head -n 1 "$d/trainer")
    sed -i 1d "$d/trainer"
    if [ -n "$state" ]; then echo "$state" > "$d/state"; fi
    exit "$code" ;;
  "compute instances describe "*) [ -f "$d/vm" ]; exit ;;
  "compute instances create "*) touch "$d/vm"; exit 0 ;;
  "compute ssh "*) case "$*" in *--follow*) exit "$(cat "$d/verifier")" ;; esac; exit 0 ;;
esac
echo "fake gcloud: unexpected call: $*" >&2
exit 99
