"""How a pod ended, in words: each process's cause (a SIGKILL named as one, not as the pod's requeue
code), then the pod's own exit code, from the launcher's "pod exit codes [...] -> N" line (launch/local.py)."""

import re
import signal

from runtime import exit_codes

POD_CODES = re.compile(r"pod exit codes \[([-\d, ]*)\] -> (-?\d+)")
POD_CODE_MEANINGS = {exit_codes.OK: "success", exit_codes.PREEMPTED: "requeue me", exit_codes.FAILURE: "failure",
                     exit_codes.BAD_INPUT: "bad input", exit_codes.UNPROVED: "not every step proved"}


def process_outcome(code: int) -> str:
    """One process's end in words: 'killed by SIGKILL', 'exit 75 (preempted)'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "aborted by the runtime (SIGABRT)" if code == -signal.SIGABRT else f"killed by {name}"
    return {exit_codes.PREEMPTED: "exit 75 (preempted)"}.get(code, f"exit {code}")


def exit_line(step_name: str, pod_code: int, log_text: str) -> str:
    """What ended a pod, from its launcher's "pod exit codes [...] -> N" line: each process's cause
    (a SIGKILL is named as one, not as the pod's requeue code), then the pod's code."""
    found = POD_CODES.findall(log_text)
    pod = f"the pod exited {pod_code} ({POD_CODE_MEANINGS.get(pod_code, 'failure')})"
    if not found:
        return f"{step_name}: {pod}"
    codes = [int(c) for c in found[-1][0].split(",") if c.strip()]
    return f"{step_name}: " + ", ".join(f"process {i} {process_outcome(c)}" for i, c in enumerate(codes)) + f"; {pod}"
