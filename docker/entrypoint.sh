#!/bin/sh
# The image's entry point: the first argument names what to run, the rest are its flags.
#   train    python -m trainer.train         (one process per host; exit 75 = preempted, requeue)
#   verify   python -m verifier.verify        (the verifier, e.g. --mesh=data=4 --follow)
#   inspect  python -m trainer.inspect (committed steps of a workdir)
#   local    python -m launch.local          (a local pod on fake CPU devices: a smoke test)
#   help     this text
# Any other first argument that is a program on PATH runs as is (e.g. bash), to debug the image.
# exec, so the Python process is PID 1 and receives SIGTERM itself: that signal starts the
# preemption save, and a shell in between would swallow it.
set -eu

usage() {
  sed -n '2,8s/^# \{0,1\}//p' "$0"
}

command_word="${1:-}"
case "$command_word" in
  train) module=trainer.train ;;
  verify) module=verifier.verify ;;
  inspect) module=trainer.inspect ;;
  local) module=launch.local ;;
  help | -h | --help) usage; exit 0 ;;
  "") echo "error: give a command: train, verify, inspect, local or help" >&2; exit 2 ;;
  *)
    if command -v "$command_word" >/dev/null 2>&1; then exec "$@"; fi
    echo "error: unknown command '$command_word': expected train, verify, inspect, local or help" >&2
    exit 2 ;;
esac
shift
exec python -m "$module" "$@"
