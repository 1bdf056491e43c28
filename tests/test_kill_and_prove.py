"""Kill it and prove it (seed 003): SIGKILL at random moments, mid-save included, then resume.

A run killed and restarted with the same command must record the same per-step loss list as an
uninterrupted run, bit for bit, and end in the same state, leaf for leaf. Every kill lands after
the attempt has started training (its first "step N loss" log line); in the mid-save plan, while
a save that this attempt started is being written.
"""

import logging
import os
import random
import re
import signal
import time

import pytest

from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps
from tests import helpers
from trainer.config import TrainConfig
from trainer.program import build_mesh, build_program, validate

STEPS = 40
TRAIN_FLAGS = ["--mesh=data=4,model=2", f"--steps={STEPS}", "--save_every_steps=5", "--max_to_keep=100",
               "--batch_size=32", "--hidden_dim=512", "--num_layers=3", "--log_every_steps=5"]
TMP_MARKER = ".orbax-checkpoint-tmp"
TRAINING_LINE = re.compile(rb"\] step \d+ loss ")  # loop.run_steps logs it every --log_every_steps


def temporary_dirs(workdir: str) -> dict[str, tuple[int, int]]:
    """{name: (inode, ctime ns)} of the killed or in-flight saves' directories."""
    directory = helpers.checkpoint_dir(workdir)
    found = {}
    for name in (os.listdir(directory) if os.path.isdir(directory) else []):
        if TMP_MARKER in name:
            try:
                stat = os.stat(os.path.join(directory, name))
            except FileNotFoundError:  # renamed at commit between listdir and stat
                continue
            found[name] = (stat.st_ino, stat.st_ctime_ns)
    return found


class Attempt:
    """One start of the trainer: what it found on disk, and what it has done since."""

    def __init__(self, workdir: str, log_path: str):
        self.workdir, self.log_path = workdir, log_path
        self.started_ns = time.time_ns()
        self.leftovers = temporary_dirs(workdir)  # a previous attempt's, removed at start-up
        self.training_lines: list[float] = []  # monotonic time each training log line was seen
        self.saves_seen: dict[str, tuple[int, int]] = {}  # every temporary directory of its own seen
        self._log_offset, self._partial_line = 0, b""

    def training(self) -> int:
        """How many training-step lines this attempt has logged so far (the log is read incrementally)."""
        if os.path.exists(self.log_path):
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                chunk = log.read()
            self._log_offset += len(chunk)
            *lines, self._partial_line = (self._partial_line + chunk).split(b"\n")
            self.training_lines += [time.monotonic() for line in lines if TRAINING_LINE.search(line)]
        return len(self.training_lines)

    def own_temporary_dirs(self) -> dict[str, tuple[int, int]]:
        """Temporary directories this attempt created: not there at its start (inode), made after it."""
        # Orbax reuses '<step>.orbax-checkpoint-tmp' names across attempts, hence the inode; file
        # times come from a coarse clock that may lag time.time_ns() by a tick, hence the 10 ms.
        own = {name: ident for name, ident in temporary_dirs(self.workdir).items()
               if self.leftovers.get(name) != ident and ident[1] >= self.started_ns - 10_000_000}
        self.saves_seen.update(own)
        return own


def kill_when(attempt: Attempt, should_kill, timeout: float = 240):
    """Starts the trainer and SIGKILLs it once `should_kill()` returns something truthy.

    Returns what should_kill returned at the kill, or None if the trainer finished first.
    """
    with helpers.started_module("trainer.train", f"--workdir={attempt.workdir}", *TRAIN_FLAGS,
                                log_path=attempt.log_path) as proc:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            reason = should_kill()
            if reason:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return reason
            time.sleep(0.001)
        assert proc.poll() is not None, "trainer did not finish in time"
        assert proc.returncode == 0, open(attempt.log_path).read()[-3000:]
        return None


def final_state(workdir: str):
    config = validate(TrainConfig(workdir=workdir, mesh=helpers.MESHES["data=4,model=2"], batch_size=32,
                                  hidden_dim=512, num_layers=3), 8)
    program = build_program(config, build_mesh(config))
    return helpers.open_service(config, program).restore(STEPS, program.abstract_state).state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def kill_plan(plan: str, attempt: Attempt, rng: random.Random):
    """should_kill for one attempt: truthy (the directories of the save being written, or True) once due.

    Both plans wait for training to begin, then spread the kills over the run: mid-save kills
    the attempt while its 1st, 2nd or 3rd save is being written; random kills it 0-1 s after its
    1st, 2nd or 3rd training line (mid-step, mid-save or in between).
    """
    nth = rng.randint(1, 3)
    if plan == "mid_save":
        def should_kill():
            own = attempt.own_temporary_dirs() if attempt.training() else {}
            return own if len(attempt.saves_seen) >= nth and own else False
        return should_kill
    delay = rng.uniform(0.0, 1.0)
    return lambda: attempt.training() >= nth and time.monotonic() - attempt.training_lines[nth - 1] > delay


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["mid_save", "random"])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, uninterrupted, plan):
    workdir = str(tmp_path / "run")
    rng = random.Random(20261130)
    kills = mid_save_kills = 0
    for number in range(3):
        attempt = Attempt(workdir, str(tmp_path / f"attempt{number}.log"))
        before = committed_steps(workdir)
        seen = kill_when(attempt, kill_plan(plan, attempt, rng))
        if seen is None:
            break
        kills += 1
        assert attempt.training(), "killed before training had begun"
        # Mid-save: a directory this attempt's save made is still there after the kill (not renamed
        # at commit between the check and the signal), and its step is not listed.
        still_writing = {name: ident for name, ident in attempt.own_temporary_dirs().items()
                         if seen is True or seen.get(name) == ident}
        if still_writing:
            mid_save_kills += 1
        logging.info("attempt %d killed after %d training lines; committed %s; mid-save: %s",
                     number, attempt.training(), committed_steps(workdir), sorted(still_writing))
        for name in still_writing:
            step = int(name.split(".")[0])
            assert step > max(before, default=0), f"{name} is not a save this attempt made after resuming"
            assert step not in committed_steps(workdir), "a half-written step must never be listed"
        assert set(before) <= set(committed_steps(workdir))
    else:
        result = helpers.run_module("trainer.train", f"--workdir={workdir}", *TRAIN_FLAGS)
        assert result.returncode == 0, result.stderr[-3000:]
    assert kills >= 1, "the run finished before any kill point was reached"
    if plan == "mid_save":
        assert mid_save_kills >= 1, f"none of {kills} kills landed mid-save"
    assert committed_steps(workdir)[-1] == STEPS
    assert not temporary_dirs(workdir), "leftover temporary directories are cleaned at start-up"

    resumed, expected = recorded_losses(workdir), recorded_losses(uninterrupted)
    assert list(expected) == list(range(STEPS))
    assert resumed == expected  # the whole list, bit for bit
    assert helpers.leaves_equal(final_state(workdir), final_state(uninterrupted))
