"""What one verifier process has decided about its verdicts: which committed steps are pending, which
it will not try again, which it must redo (--reverify), and the line it exits with.

- A complete verdict for the step's save (its manifest digest) is never redone, unless --reverify names
  the step; then once per process, and the old verdict stays until a complete new one replaces it
  (checkpointing/_src/verdicts.py write).
- An `error` (a fault of the verifier, verifier/faults.py) is written incomplete, so the next verifier run
  retries the step; this process does not (under --follow no step is retried in a loop), unless the step
  is saved again (another digest).
- A complete verdict refused by the write (a `fail` for a save already proved, as a step being deleted
  reads) is kept, and not tried again here either.
"""

from absl import logging

from checkpointing.verification import verdicts
from checkpointing.errors import CheckpointError
from verifier.faults import VerdictWriteError

ALL = "all"


class Ledger:
    def __init__(self, workdir: str, reverify: tuple[int, ...] | str = ()):
        self.workdir = workdir
        # --reverify: the steps still to redo in this process (ALL: every step committed at the first listing)
        self._reverify: set[int] | None = None if reverify == ALL else set(reverify)
        self._not_retried: dict[int, str | None] = {}  # step -> the manifest digest it was tried with
        self.unproved: dict[int, str] = {}  # step -> why this process could not prove it (the exit line)

    def pending(self, committed: list[int], found: dict[int, dict]) -> list[int]:
        """The committed steps to prove, oldest first: no complete verdict of their save (`found`:
        verdicts.current_steps), or named by --reverify; less those this process will not try again."""
        if self._reverify is None:
            self._reverify = set(committed)
        return [step for step in committed
                if (step not in found or not found[step]["complete"] or step in self._reverify)
                and not self._given_up(step, found.get(step))]

    def _given_up(self, step: int, current: dict | None) -> bool:
        """Whether this process tried `step` as it is now (the same digest) and will not again."""
        if step not in self._not_retried:
            return False
        tried = self._not_retried[step]
        if current is not None:  # the verdict of the save on disk: is it the one this process wrote?
            return current.get("manifest_digest") == tried
        return verdicts.digest_on_disk(self.workdir, step) == tried  # a refused write: nothing of it on disk

    def write(self, verdict: dict, *, primary: bool) -> bool:
        """Keeps the books of `verdict` (every process), and writes it (process 0: `primary`); returns
        whether it was written."""
        step, digest = verdict["step"], verdict["manifest_digest"]
        redo = self._reverify is not None and step in self._reverify
        if verdict["status"] == "error":
            self._not_retried[step] = digest
            self.unproved[step] = verdict["detail"]
        if self._reverify is not None and (verdict["complete"] or verdict["status"] == "error"):
            self._reverify.discard(step)  # redone once
        if not primary:
            return False
        try:
            written = verdicts.write(self.workdir, verdict, replace=redo)
        except CheckpointError as err:
            raise VerdictWriteError(str(err)) from err
        if verdict["complete"] and written:
            self.unproved.pop(step, None)
            self._not_retried.pop(step, None)
        elif verdict["complete"]:
            self._keep(verdict)
        return written

    def _keep(self, refused: dict) -> None:
        step = refused["step"]
        kept = verdicts.read(self.workdir, step) or {}
        self._not_retried[step] = refused["manifest_digest"]
        self.unproved[step] = (f"step {step}: {refused['level']} {refused['status']} ({refused['detail']}), and its "
                               f"complete verdict {kept.get('level')} {kept.get('status')} is kept (--reverify={step} "
                               "replaces it)")
        logging.warning("%s", self.unproved[step])

    def tally(self, committed: list[int]) -> dict[str, list[int]]:
        """Every committed step by what its current verdict says: `proved` (a resumes or reproduced pass),
        `failed`, or `unproved` (intact only, replayed, inconclusive, an error, or no verdict of its save)."""
        found = verdicts.current_steps(self.workdir, committed)
        tally = {"proved": [], "failed": [], "unproved": []}
        for step in committed:
            verdict = found.get(step)
            if verdicts.is_proved(verdict) and step not in self.unproved:
                tally["proved"].append(step)
            elif verdict is not None and verdict["status"] == "fail":
                tally["failed"].append(step)
            else:
                tally["unproved"].append(step)
        return tally

    def exit_line(self, committed: list[int]) -> str | None:
        """None when no committed step failed and none is left unproved by a fault of the verifier's; else
        one line: 'failing verdicts for steps [..]' (evidence), then 'the verifier could not prove steps
        [..]: <cause>' (faults), each only if it has steps."""
        found = verdicts.current_steps(self.workdir, committed)
        failing = [step for step, verdict in found.items() if verdict["status"] == "fail"]
        unproved = {step: verdict["detail"] for step, verdict in found.items() if verdict["status"] == "error"}
        unproved.update({step: why for step, why in self.unproved.items() if step in committed})
        inconclusive = [step for step, verdict in found.items() if verdict["status"] == "inconclusive"]
        if inconclusive:
            logging.warning("inconclusive verdicts for steps %s (not proved; their details say why)", inconclusive)
        parts = [f"failing verdicts for steps {failing}"] if failing else []
        if unproved:
            parts.append(f"the verifier could not prove steps {sorted(unproved)}: {_causes(unproved)}")
        return "; ".join(parts) or None


def _causes(unproved: dict[int, str]) -> str:
    """The causes, each once, each followed by its steps when there are several."""
    steps_of: dict[str, list[int]] = {}
    for step in sorted(unproved):
        steps_of.setdefault(unproved[step], []).append(step)
    if len(steps_of) == 1:
        return next(iter(steps_of))
    return "; ".join(f"{cause} (steps {steps})" for cause, steps in steps_of.items())
