"""The proofs of one checkpoint, on the verifier's own mesh, read only (verifier/verifier.py runs them
over a workdir and writes the verdicts).

Proofs run forward, so that blame lands on the step that is wrong (levels: checkpointing/_src/verdicts.py):
  intact      restore onto the verifier's mesh from an explicit abstract target: the manifest
              matches its digest, every fingerprint its leaf (checked by the service), every value
              is finite and the step counter is the step. Written at once (complete=false).
  resumes     the cheap proof (verifier/resume_proof.py), at every save the trainer recorded a probe
              for: the few steps it replays from the checkpoint give what the trainer computed after
              it. k steps whatever the interval, so it keeps pace at any scale.
  reproduced  the full proof (verifier/chain_proof.py): a replay from the newest proved predecessor
              (the run's init for the first checkpoint, or the params it imported with --init_from)
              up to this step: every loss the step recorded, and then its whole state, must come out
              equal: value for value on the recording layout and platform, within MARGIN times the noise
              of a layout change measured for the interval on another (verifier/evidence.py). With
              --verify_budget below 1 it is given to a sample of the saves
              (verifier/budget.py); at 1, to every one, so the chain of trust goes back to the seed.
  replayed    the weaker level when the distance exceeds --replay_steps: the replay compared the
              losses it reached, the step's own state is not proved.
A proved step becomes the next proof's start. A tampered step fails its own proof; its predecessor
stays proved and its successor is proved from the predecessor. It only reads checkpoints; the one
thing it writes is verdicts.
"""

import dataclasses
import time

import jax
from absl import logging

from checkpointing.verification import compare
from checkpointing.verification import content
from checkpointing.verification import restore as restore_lib
from checkpointing.verification import verdicts
from checkpointing.errors import (CheckpointError, FingerprintMismatchError, StorageUnavailableError,
                                  TreeMismatchError)
from checkpointing.verification import is_committed, read_manifest
from runtime import collective
from verifier import faults
from verifier import identity
from verifier import program as program_lib
from verifier import resume_proof
from verifier.chain_proof import INIT, Anchor, ChainProver  # noqa: F401 (INIT: re-exported)
from verifier.context import ProofContext, VerifierOptions  # noqa: F401 (VerifierOptions: re-exported)

# A step being deleted (Orbax removes its files one by one) is still listed meanwhile: a file found
# missing is looked at again this long before it is called evidence.
DELETION_SECS = 1.0


@dataclasses.dataclass(frozen=True)
class HeldStep:
    """An intact step, restored once and held for its replay (its intact verdict is written)."""

    state: object
    manifest: dict
    program: object  # verifier/program.py's protocol
    durations: dict
    input_states: list | None = None


class StepProver:
    """The proofs of one step: intact (restore and check), the cheap proof, the choice of the full one (its
    ChainProver's, which this prover holds) and every verdict's shape; shared state in `context`."""

    def __init__(self, context: ProofContext):
        self._context = context
        self._options = context.options
        self._chain = ChainProver(context, self.verdict)

    def intact(self, step: int) -> tuple[dict, HeldStep | None]:
        """(verdict, None) when `step` is not intact (complete; an error is not), else (its intact verdict,
        what its replay needs, restored once)."""
        durations, started = {}, time.perf_counter()
        manifest = {}
        try:
            manifest = read_manifest(self._options.workdir, step)
            problem = identity.difference(step, manifest, self._context.run_manifest())
            # Every process restores or none does (a collective): process 0's answer is everyone's.
            if collective.decided_by_primary(lambda: problem is not None):
                return self.verdict(step, manifest, "intact", "fail", problem or f"step {step} is not this run's",
                                    durations), None
            program = self._context.program_for(manifest)
            state = self._context.service.restore(step, program.abstract_state).state
            inputs = program_lib.input_states(self._options.workdir, step, program)
        except Exception as err:  # evidence or the verifier's own fault: verifier/faults.py decides which
            return self.not_proved(step, manifest, "intact", err, durations, evidence_possible=True), None
        durations["restore"] = time.perf_counter() - started
        problem = _intact_problem(step, state)
        if problem:
            return self.verdict(step, manifest, "intact", "fail", problem.detail, durations,
                                mismatch=problem.as_dict()), None
        intact = self.verdict(step, manifest, "intact", "pass",
                              f"all {len(manifest['leaves'])} leaf fingerprints equal, every value finite", durations,
                              complete=False)
        return intact, HeldStep(state, manifest, program, durations, inputs)

    def not_proved(self, step: int, manifest: dict, level: str, err: Exception, durations: dict, *,
                   evidence_possible: bool) -> dict:
        """The verdict of a proof that raised `err`: `gone` if the step was deleted meanwhile, `fail` on evidence
        against it (only where the step's own files were being read), else `error` (verifier/faults.py),
        written incomplete so that the next verifier run retries it."""
        if self.deleted(step, err):
            return self.verdict(step, manifest, level, "gone", f"deleted while being verified ({_first_line(err)})",
                                durations)
        if evidence_possible and faults.is_evidence(err):
            mismatch = _leaf_mismatch(err) if isinstance(err, (FingerprintMismatchError, TreeMismatchError)) else None
            return self.verdict(step, manifest, level, "fail", _first_line(err) or type(err).__name__, durations,
                                mismatch=mismatch)
        logging.warning("step %d: the verifier could not prove it: %s", step, faults.cause(err))
        logging.vlog(1, "step %d: where the proof stopped", step, exc_info=err)  # one line unless -v=1
        return self.verdict(step, manifest, level, "error", faults.cause(err), durations, complete=False)

    def deleted(self, step: int, err: Exception | None = None) -> bool:
        """Whether `step` was deleted (retention) while it was proved. A step is removed file by file while it
        is still listed: a file missing from it is looked at again for up to DELETION_SECS."""
        deadline = time.monotonic() + (DELETION_SECS if err is not None and faults.is_missing_file(err) else 0)
        while is_committed(self._options.workdir, step):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def prove(self, step: int, held: HeldStep, disk_anchor: int | None) -> dict | None:
        """The complete verdict of an intact step: the cheap proof where the trainer recorded a probe
        (verifier/resume_proof.py), then the full proof where the budget gives one (verifier/budget.py).
        None: under --follow its probe is still to come (the trainer records it k steps after the save)."""
        manifest = held.manifest
        foreign = program_lib.code_change(held.program, [manifest])
        if foreign is not None:
            # Replayed with this verifier's computation, a step computed by another would differ for that reason
            # alone: neither proof can decide (never a fail), and its probe is not awaited.
            return self.verdict(step, manifest, "reproduced", "inconclusive",
                                f"fingerprints equal; not reproduced: its computation is not the one this verifier "
                                f"runs ({foreign}); a verifier on the code that computed it proves it "
                                f"(--reverify={step})", held.durations)
        final = manifest.get("reason") == "final"
        probe = resume_proof.agreed_probe(self._options.workdir, step, manifest)
        if probe is None and collective.decided_by_primary(
                lambda: resume_proof.awaits_probe(self._options, step, final)):
            return None
        resume = None
        if probe is not None:
            started = time.perf_counter()
            resume = resume_proof.prove(
                self._context.replay, held.program, held.state, step, probe, manifest,
                lambda: self._context.other_programs(manifest),
                lambda program: program_lib.batches_at(program, held.input_states, held.input_states))
            held.durations["resume_proof"] = time.perf_counter() - started
        distance = step - self._chain.anchor_step(step, manifest, disk_anchor)
        logging.vlog(1, "step %d: cheap proof %s; full proof over %d steps next unless not due", step,
                     "done" if resume is not None else "not run (no probe)", distance)
        cheap_failed = resume is not None and resume.status == "fail"
        if not self._context.budget.full_due(step, distance, final=final, has_probe=probe is not None,
                                             cheap_failed=cheap_failed):
            verdict = self._resume_verdict(step, held, resume,
                                           f"; the full proof is not due ({self._context.budget.describe()})")
        else:
            verdict = self._full_proof(step, held, disk_anchor)
            if cheap_failed and verdict["status"] == "pass":
                # The step is what its replay gives: the steps recorded after it are what diverged (a broken
                # resume from it, or a fault after it), and the next save's proof names the first of them.
                verdict["detail"] += (f"; the {resume.steps} steps recorded after it do not replay from it "
                                      f"({resume.mismatch.detail}): the next save's full proof says where they went")
            elif cheap_failed and verdict["status"] == "inconclusive":
                verdict = self._resume_verdict(step, held, resume, "")
            elif resume is not None and resume.status == "pass" and verdict["status"] == "inconclusive":
                verdict = self._resume_verdict(step, held, resume, f"; the full proof could not decide: "
                                                                   f"{verdict['detail']}")
            elif resume is not None and resume.status == "pass":
                verdict["detail"] += f"; it resumes the run ({resume.steps} steps replayed from it)"
        if verdict["status"] == "pass" and verdict["level"] in verdicts.PROVED_LEVELS:  # only a passed proof anchors
            self._chain.proved(Anchor(step, held.state, manifest["fixed_hash"], held.input_states,
                                      cheap_only=verdict["level"] != "reproduced"))
            if jax.process_index() == 0:  # what it proved, bound to the verdict (checkpointing/_src/content.py)
                verdict["content_sha256"] = content.leaf_digests(held.state)
        return verdict

    def _full_proof(self, step: int, held: HeldStep, disk_anchor: int | None) -> dict:
        """The full proof's verdict; inconclusive where it cannot start: the run's start is another run's step
        (--init_from) that is gone or no longer the save it recorded. Every later step is still proved (from a
        step the cheap proof passed)."""
        try:
            anchor = self._chain.anchor_for(step, held.manifest, held.program, disk_anchor)
        except StorageUnavailableError:
            raise  # a fault of the verifier's own reads, not something the checkpoint could answer for
        except CheckpointError as err:
            return self.verdict(step, held.manifest, "intact", "inconclusive",
                                f"the full proof cannot start from {identity.init_origin(held.manifest)}: {err}",
                                held.durations)
        verdict = self._chain.prove(step, held, anchor)
        if verdict["status"] != "fail" or not anchor.cheap_only:
            return verdict
        return self._proved_again(step, held, anchor, verdict)

    def _proved_again(self, step: int, held: HeldStep, suspect: Anchor, failed: dict) -> dict:
        """A full proof failed from an anchor only the cheap proof had proved: the step is proved again from the
        newest fully proved step before it (or the init). If it passes from there, the anchor is what differs:
        it is proved in full from there too, and that verdict (its evidence) replaces its cheap one."""
        older = self._chain.reproduced_anchor_before(suspect.step, held.manifest, held.program)
        logging.warning("step %d: its full proof from step %d (proved by the cheap proof alone) failed; proving it "
                        "again from %s before blaming it", step, suspect.step,
                        f"step {older.step}" if older.step != INIT else "the init")
        verdict = self._chain.prove(step, held, older)
        if verdict["status"] != "pass":
            return verdict
        manifest = read_manifest(self._options.workdir, suspect.step)
        anchor_held = HeldStep(suspect.state, manifest, held.program, {}, suspect.input_states)
        blamed = self._chain.prove(suspect.step, anchor_held, older)
        if blamed["status"] == "fail" and jax.process_index() == 0:  # evidence against the anchor: its own verdict
            logging.error("verdict step %d: %s %s: %s", suspect.step, blamed["level"], blamed["status"],
                          blamed["detail"])
            verdicts.write(self._options.workdir, blamed, replace=True)
        verdict["detail"] += (f"; its full proof from step {suspect.step}, which only the cheap proof had proved, "
                              f"failed ({failed['detail']}): step {suspect.step} is "
                              f"{'what differs' if blamed['status'] == 'fail' else 'not proved in full'}")
        return verdict

    def _resume_verdict(self, step: int, held: HeldStep, resume, why_only: str) -> dict:
        """The verdict of the cheap proof alone (a passing one anchors the next full proof)."""
        detail = resume.describe() + (why_only if resume.status == "pass" else "")
        return self.verdict(step, held.manifest, "resumes", resume.status, detail, held.durations,
                            mismatch=resume.mismatch and resume.mismatch.as_mismatch(),
                            max_difference=resume.largest, replayed_from=step, replayed=resume.steps,
                            compared=resume.compared_losses, judgement=None if resume.exact else resume.judgement)

    def verdict(self, step, manifest, level, status, detail, durations, *, complete=True, mismatch=None,
                max_difference=None, replayed_from=None, replayed=0, compared=0, judgement=None) -> dict:
        """Every verdict's one shape (checkpointing/_src/verdicts.py): the chain's are built here too."""
        return verdicts.make(step=step, level=level, status=status, complete=complete, detail=detail,
                             mismatch=mismatch, checkpoint_mesh=manifest.get("mesh", {}),
                             verifier_mesh=self._context.mesh_shape(), durations_secs=durations,
                             max_relative_difference=max_difference, replayed_from=replayed_from,
                             replayed_steps=replayed, compared_losses=compared,
                             manifest_digest=manifest.get("digest"),
                             evidence=judgement.as_record() if judgement is not None else None)


def _intact_problem(step: int, state) -> compare.Mismatch | None:
    """What is wrong with a restored state on its own: its counter, or a NaN/Inf in a leaf."""
    try:
        restore_lib.check_step_counter(step, state)
    except CheckpointError as err:
        return compare.Mismatch("leaf", ".step", step, None, str(err))
    bad = compare.nonfinite_leaves(state)
    if bad:
        return compare.Mismatch("leaf", bad[0], None, None,
                                f"leaf {bad[0]} holds NaN or Inf ({len(bad)} leaf(s): {', '.join(bad)})")
    return None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def _leaf_mismatch(err: Exception) -> dict:
    if isinstance(err, FingerprintMismatchError):
        return {"kind": "leaf", "where": err.path, "expected": err.expected, "actual": err.actual}
    return {"kind": "tree", "where": str(err), "expected": None, "actual": None}
