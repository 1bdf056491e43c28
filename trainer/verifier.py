"""The verifier: proves each committed checkpoint on its own mesh, read-only, and writes verdicts.

Two levels per step:
  intact        restore onto the verifier's mesh from an explicit abstract target; every leaf's
                fingerprint equals the manifest (checked by the service) and the step counter
                equals the step.
  reproducible  once the next checkpoint exists, replay up to `replay_steps` steps from the restored
                state with the trainer's own step and data, and compare the loss list with the one
                the successor recorded: bit-exact on the mesh that recorded it, within
                CROSS_MESH_LOSS_RTOL otherwise. A replay that reaches the successor also compares
                the whole state with it (fingerprints on the same mesh, a relative norm per leaf
                otherwise).
It only reads checkpoints; the one thing it writes is verdicts (checkpointing.verdicts).
"""

import dataclasses
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from checkpointing import fingerprint as fingerprint_lib
from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing.errors import CheckpointError, FingerprintMismatchError, TreeMismatchError
from checkpointing.service import CheckpointService, committed_steps, read_manifest
from trainer import loop
from trainer.config import TrainConfig, validate
from trainer.program import build_mesh, build_program
from trainer.step import CROSS_MESH_LOSS_RTOL, CROSS_MESH_STATE_RTOL


@dataclasses.dataclass(frozen=True)
class VerifierOptions:
    workdir: str  # the trainer's workdir (local path or gs://)
    mesh: tuple[tuple[str, int], ...] = ()  # the verifier's own mesh; () means data=<its devices>
    replay_steps: int = 100  # replay at most this many steps towards the successor
    poll_secs: float = 1.0  # first wait between directory polls in --follow
    max_poll_secs: float = 30.0  # polls back off (x2 when nothing new) up to this


class Verifier:
    def __init__(self, options: VerifierOptions):
        self.options = options
        self._programs: dict[str, tuple] = {}  # fixed_hash -> (program, read-only service)

    def _program_for(self, manifest: dict):
        key = manifest["fixed_hash"]
        if key not in self._programs:
            config = TrainConfig.from_json(manifest["config"])
            config = validate(dataclasses.replace(config, workdir=self.options.workdir, mesh=self.options.mesh,
                                                  resume_from="latest"), jax.device_count())
            program = build_program(config, build_mesh(config))
            service = CheckpointService(self.options.workdir, read_only=True)
            self._programs[key] = (program, service)
        return self._programs[key]

    # --- one step ------------------------------------------------------------------------------

    def verify(self, step: int, successor: int | None = -1) -> dict:
        """Verifies `step` at the highest level its successors allow; returns the verdict (not written).

        `successor` is the next committed step (None: there is none); -1 means look it up.
        """
        durations = {}
        started = time.perf_counter()
        checkpoint_mesh = {}
        try:
            manifest = read_manifest(self.options.workdir, step)
            checkpoint_mesh = manifest["mesh"]
            program, service = self._program_for(manifest)
            restored = service.restore(step, program.abstract_state)
            state = restored.state
            durations["restore"] = time.perf_counter() - started
        except (FingerprintMismatchError, TreeMismatchError) as err:
            return self._verdict(step, checkpoint_mesh, "intact", "fail", str(err), durations,
                                 mismatch=_leaf_mismatch(err))
        except CheckpointError as err:
            if step not in committed_steps(self.options.workdir):
                return self._verdict(step, checkpoint_mesh, "intact", "gone", f"deleted while being verified ({err})",
                                     durations)
            return self._verdict(step, checkpoint_mesh, "intact", "fail", str(err), durations)
        if int(state.step) != step:
            return self._verdict(step, checkpoint_mesh, "intact", "fail",
                                 f"leaf .step holds {int(state.step)}, the checkpoint is step {step}", durations,
                                 mismatch={"kind": "leaf", "where": ".step", "expected": step, "actual": int(state.step)})
        if successor == -1:
            successor = next((s for s in committed_steps(self.options.workdir) if s > step), None)
        if successor is None:
            return self._verdict(step, checkpoint_mesh, "intact", "pass",
                                 f"all {len(manifest['leaves'])} leaf fingerprints equal", durations)
        return self._check_reproducible(step, state, program, checkpoint_mesh, successor, durations)

    def _check_reproducible(self, step, state, program, checkpoint_mesh, successor, durations) -> dict:
        try:
            successor_manifest = read_manifest(self.options.workdir, successor)
        except CheckpointError:  # deleted by retention meanwhile: intact is all this pass can prove
            return self._verdict(step, checkpoint_mesh, "intact", "pass", "fingerprints equal; successor gone", durations)
        recorded = manifest_lib.losses(successor_manifest)
        steps = []
        for s in range(step, min(successor, step + self.options.replay_steps)):
            if s not in recorded:
                break
            steps.append(s)
        if not steps:
            return self._verdict(step, checkpoint_mesh, "intact", "pass",
                                 f"fingerprints equal; successor {successor} records no losses from step {step}",
                                 durations, successor=successor)
        started = time.perf_counter()
        state, replayed = loop.replay_losses(program, state, step, len(steps))
        durations["replay"] = time.perf_counter() - started
        # Bit-exact only on the layout that recorded the losses: the same mesh in the same number
        # of processes (gloo's cross-process reductions add in another order than in-process ones).
        exact = (dict(program.mesh.shape) == successor_manifest["mesh"]
                 and jax.process_count() == successor_manifest["process_count"])
        rtol = 0.0 if exact else CROSS_MESH_LOSS_RTOL[program.config.model]
        differences = {s: abs(replayed[s] - recorded[s]) / max(abs(recorded[s]), 1e-30) for s in steps}
        max_difference = max(differences.values())
        common = dict(checkpoint_mesh=checkpoint_mesh, durations=durations, max_difference=max_difference,
                      replayed=len(steps), successor=successor)
        for s in steps:
            if (replayed[s] != recorded[s]) if exact else differences[s] > rtol:
                return self._verdict(
                    step, level="reproducible", status="fail",
                    detail=f"replayed loss of step {s} is {replayed[s]!r}, step {successor} recorded {recorded[s]!r}"
                           f" ({'exact' if exact else f'rtol {rtol:g}'} comparison)",
                    mismatch={"kind": "loss", "where": s, "expected": recorded[s], "actual": replayed[s]}, **common)
        if step + len(steps) == successor:
            problem = self._compare_with_successor(state, program, successor, successor_manifest, exact)
            if problem:
                return self._verdict(step, level="reproducible", status="fail", detail=problem[0],
                                     mismatch=problem[1], **common)
        return self._verdict(step, level="reproducible", status="pass",
                             detail=f"fingerprints equal; {len(steps)} replayed losses match step {successor}"
                                    f" ({'bit-exact' if exact else f'max rel diff {max_difference:.2e}'})"
                                    + ("; state equals the successor" if step + len(steps) == successor else ""),
                             **common)

    def _compare_with_successor(self, state, program, successor, successor_manifest, exact):
        """None if the replayed state equals the successor's; else (detail, mismatch)."""
        if exact:
            actual = fingerprint_lib.fingerprint_tree(state)
            for path, leaf in successor_manifest["leaves"].items():
                if actual[path] != leaf["fingerprint"]:
                    return (f"replayed state differs from step {successor} at leaf {path}",
                            {"kind": "leaf", "where": path, "expected": leaf["fingerprint"], "actual": actual[path]})
            return None
        _, service = self._programs[successor_manifest["fixed_hash"]]
        try:
            expected = dict(_flat(service.restore(successor, program.abstract_state).state))
        except CheckpointError:
            return None  # an unreadable successor fails its own verdict; the losses above still matched
        squared = {path: float(np.sum((np.asarray(leaf, np.float64) - np.asarray(expected[path], np.float64)) ** 2))
                   for path, leaf in _flat(state)}
        scale = sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in expected.values())
        relative = float(np.sqrt(sum(squared.values()) / max(scale, 1e-30)))
        if relative > CROSS_MESH_STATE_RTOL[program.config.model]:
            worst = max(squared, key=squared.get)
            return (f"replayed state differs from step {successor}: relative norm {relative:.2e}, most at leaf {worst}",
                    {"kind": "state", "where": worst, "expected": CROSS_MESH_STATE_RTOL[program.config.model],
                     "actual": relative})
        return None

    def _verdict(self, step, checkpoint_mesh, level, status, detail, durations, *, mismatch=None,
                 max_difference=None, replayed=0, successor=None) -> dict:
        return verdicts.make(step=step, level=level, status=status, detail=detail, mismatch=mismatch,
                             checkpoint_mesh=checkpoint_mesh, verifier_mesh=self._mesh_shape(), durations_secs=durations,
                             max_relative_difference=max_difference, replayed_steps=replayed, successor=successor)

    def _mesh_shape(self) -> dict:
        if self._programs:
            return dict(next(iter(self._programs.values()))[0].mesh.shape)
        return dict(self.options.mesh) or {"data": jax.device_count()}

    # --- the workdir ---------------------------------------------------------------------------

    def pending_steps(self) -> list[int]:
        """Steps to verify, newly committed ones first (their intact proof is what a resume waits
        for), then intact-only steps that a successor can now upgrade to reproducible."""
        committed = committed_steps(self.options.workdir)
        existing = verdicts.read_all(self.options.workdir)
        new, upgrades = [], []
        for index, step in enumerate(committed):
            verdict = existing.get(step)
            if verdict is None:
                new.append(step)
            elif (self.options.replay_steps > 0 and index + 1 < len(committed) and verdict["level"] == "intact"
                  and verdict["status"] == "pass" and verdict.get("successor") != committed[index + 1]):
                upgrades.append(step)
        return new + upgrades

    def verify_pending(self) -> list[dict]:
        """Verifies every pending step once and writes its verdict; returns the verdicts."""
        written = []
        for step, successor in self._agreed_plan():
            verdict = self.verify(step, successor)  # every process takes part: restores and replays are collective
            if jax.process_index() != 0:
                written.append(verdict)
                continue
            verdicts.write(self.options.workdir, verdict)
            logging.log(logging.INFO if verdict["status"] != "fail" else logging.ERROR,
                        "verdict step %d: %s %s: %s", step, verdict["level"], verdict["status"], verdict["detail"])
            written.append(verdict)
        return written

    def follow(self, stop: threading.Event, until_step: int | None = None) -> list[dict]:
        """Verifies steps as they commit until `until_step` (or the run's final step) is verified."""
        written, delay = [], self.options.poll_secs
        while not stop.is_set():
            fresh = self.verify_pending()
            written += fresh
            if self._finished(until_step):
                break
            delay = self.options.poll_secs if fresh else min(delay * 2, self.options.max_poll_secs)
            stop.wait(delay)
        return written

    def _agreed_plan(self) -> list[tuple[int, int | None]]:
        """(step, successor) pairs to verify, decided by process 0 and the same on every process.

        Processes listing the directory themselves could see different steps (a commit lands
        between two listings) and then replay different lengths: a deadlock in the collectives.
        """
        plan = []
        if jax.process_index() == 0:
            committed = committed_steps(self.options.workdir)
            for step in self.pending_steps():
                plan.append((step, next((s for s in committed if s > step), None)))
        if jax.process_count() == 1:
            return plan
        rows = np.array([[step, -2 if successor is None else successor] for step, successor in plan] or
                        np.zeros((0, 2)), np.int64).reshape(-1, 2)
        count = int(multihost_utils.broadcast_one_to_all(np.int32(len(rows))))
        padded = np.zeros((max(count, 1), 2), np.int32)
        padded[:len(rows)] = rows
        padded = np.asarray(multihost_utils.broadcast_one_to_all(padded))[:count]
        return [(int(step), None if successor == -2 else int(successor)) for step, successor in padded]

    def _finished(self, until_step: int | None) -> bool:
        finished = self._finished_here(until_step) if jax.process_index() == 0 else False
        if jax.process_count() > 1:
            finished = bool(multihost_utils.broadcast_one_to_all(np.int32(finished)))
        return finished

    def _finished_here(self, until_step: int | None) -> bool:
        if self.pending_steps():
            return False
        committed = committed_steps(self.options.workdir)
        if not committed:
            return False
        last = committed[-1]
        if until_step is not None:
            return last >= until_step
        return read_manifest(self.options.workdir, last)["reason"] == "final"


def _flat(tree):
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaf_mismatch(err: Exception) -> dict:
    if isinstance(err, FingerprintMismatchError):
        return {"kind": "leaf", "where": err.path, "expected": err.expected, "actual": err.actual}
    return {"kind": "tree", "where": str(err), "expected": None, "actual": None}
