"""In-process: which failures are evidence against a step (`fail`) and which are faults of the verifier
(`error`), on real errors raised by the real code (verifier/faults.py); a manifest naming another step
than its directory is corrupt; and the verifier's books (verifier/ledger.py): what is pending, what one
process does not retry, what --reverify redoes, and the one line it exits with."""

import errno
import json
import os

import jax.numpy as jnp
import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import reads, verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CorruptCheckpointError, ManifestError, StorageUnavailableError
from verifier import faults
from verifier import program as program_lib
from verifier.ledger import ALL, Ledger

SAVE = "a" * 64


def raised(function, *args):
    with pytest.raises(Exception) as caught:
        function(*args)
    return caught.value


def test_a_missing_file_and_a_damaged_manifest_are_evidence(tmp_path):
    missing = raised(reads.read_retrying, (tmp_path / "gone").read_text, "step 30: reading x")
    assert isinstance(missing, CorruptCheckpointError) and faults.is_evidence(missing)
    assert faults.is_missing_file(missing)
    assert faults.is_evidence(raised(open, tmp_path / "gone"))  # an OSError whose cause is the data itself
    damaged = raised(manifest_lib.parse, "{", "step 30 manifest")
    assert isinstance(damaged, ManifestError) and faults.is_evidence(damaged)


def write_manifest(workdir: str, directory_step: int, recorded_step: int) -> None:
    manifest = manifest_lib.build(step=recorded_step, leaves={}, fingerprints={}, losses={10: 1.5}, config={},
                                  fixed_hash="x", fixed_fields={}, mesh={"data": 1}, reason="interval")
    path = workdir_lib.manifest_file(workdir, directory_step)
    os.makedirs(path.parent)
    path.write_text(json.dumps(manifest))


def test_a_manifest_recording_another_step_than_its_directory_is_corrupt(tmp_path):
    workdir = str(tmp_path)
    write_manifest(workdir, 10, 10)
    assert workdir_lib.read_manifest(workdir, 10)["step"] == 10
    write_manifest(workdir, 5, 10)  # another run's step 10 copied in as checkpoints/5
    with pytest.raises(CorruptCheckpointError, match=r"^step 5: its manifest records step 10 \(.*/checkpoints/5/"):
        workdir_lib.read_manifest(workdir, 5)


@pytest.mark.parametrize("reference, cause", [
    ("no_such_package.own_loop:replay_program", "program no_such_package.own_loop:replay_program: cannot import it "
                                                "(ModuleNotFoundError: No module named 'no_such_package')"),
    ("json:loads", "program json:loads: cannot build it from the recorded config (TypeError: "),  # it raises
])
def test_a_program_that_cannot_be_imported_or_built_is_the_verifiers_fault(reference, cause):
    error = raised(program_lib.load, {"program": reference, "config": {"seed": 0}}, None)
    assert isinstance(error, program_lib.ProgramError) and not faults.is_evidence(error)
    assert faults.cause(error).startswith(cause), faults.cause(error)


def test_out_of_memory_an_unavailable_storage_and_a_bug_are_the_verifiers_faults():
    oom = raised(lambda: jnp.zeros((2 ** 42,), jnp.float32).block_until_ready())  # 16 TiB: XLA refuses it
    assert not faults.is_evidence(oom)
    assert faults.cause(oom).startswith("out of memory on the verifier's devices (RESOURCE_EXHAUSTED: "), \
        faults.cause(oom)
    storage = StorageUnavailableError("step 30: reading its arrays from /w failed 4 times: input/output error")
    assert not faults.is_evidence(storage) and faults.cause(storage) == str(storage)
    assert not faults.is_evidence(OSError(errno.EIO, "Input/output error"))
    bug = raised(lambda: {}["leaves"])
    assert not faults.is_evidence(bug) and faults.cause(bug) == "KeyError: 'leaves'"


def verdict(step: int, level: str = "reproduced", status: str = "pass", **fields) -> dict:
    return verdicts.make(step=step, level=level, status=status, detail=fields.pop("detail", f"step {step}: test"),
                         checkpoint_mesh={}, verifier_mesh={}, durations_secs={},
                         **{"manifest_digest": SAVE, **fields})


def test_an_error_is_not_retried_by_the_process_that_wrote_it_but_by_the_next(tmp_path):
    workdir = str(tmp_path)
    ledger = Ledger(workdir)
    ledger.write(verdict(10), primary=True)
    ledger.write(verdict(20, level="intact", status="error", complete=False, detail="program x: cannot import it"),
                 primary=True)
    found = {step: verdicts.read(workdir, step) for step in (10, 20)}
    assert ledger.pending([10, 20, 30], found) == [30]  # 10 complete; 20 errored here: not again
    assert Ledger(workdir).pending([10, 20, 30], found) == [20, 30]  # the next verifier run retries it
    assert ledger.pending([10, 20, 30], {10: found[10]}) == [20, 30]  # saved again: its verdict is not this save's
    assert ledger.exit_line([10, 20, 30]) == "the verifier could not prove steps [20]: program x: cannot import it"


def test_reverify_redoes_complete_verdicts_once_per_process(tmp_path):
    workdir = str(tmp_path)
    for step in (10, 20):
        verdicts.write(workdir, verdict(step))
    found = {step: verdicts.read(workdir, step) for step in (10, 20)}
    assert Ledger(workdir).pending([10, 20], found) == []
    ledger = Ledger(workdir, (20,))
    assert ledger.pending([10, 20], found) == [20]
    assert ledger.write(verdict(20, level="intact", complete=False), primary=True) is False  # the old one stays
    assert ledger.write(verdict(20, status="fail", detail="step 20: redone"), primary=True) is True
    assert verdicts.read(workdir, 20)["detail"] == "step 20: redone"
    assert ledger.pending([10, 20], {**found, 20: verdicts.read(workdir, 20)}) == []  # redone once
    assert Ledger(workdir, ALL).pending([10, 20], found) == [10, 20]


def test_the_exit_line_names_failing_steps_then_the_unproved_ones_with_their_causes(tmp_path, monkeypatch):
    workdir = str(tmp_path)
    monkeypatch.setattr(verdicts, "digest_on_disk", lambda workdir, step: SAVE)  # no manifests in this workdir
    ledger = Ledger(workdir)
    assert ledger.exit_line([10]) is None
    ledger.write(verdict(10, status="fail"), primary=True)
    assert ledger.exit_line([10, 20]) == "failing verdicts for steps [10]"
    for step in (20, 30):
        ledger.write(verdict(step, level="intact", status="error", complete=False,
                             detail="program x: cannot import it (ModuleNotFoundError)"), primary=True)
    assert ledger.exit_line([10, 20, 30]) == ("failing verdicts for steps [10]; the verifier could not prove steps "
                                              "[20, 30]: program x: cannot import it (ModuleNotFoundError)")
    ledger.write(verdict(40, status="error", complete=False, detail="out of memory"), primary=True)
    assert ledger.exit_line([20, 30, 40]) == ("the verifier could not prove steps [20, 30, 40]: program x: cannot "
                                              "import it (ModuleNotFoundError) (steps [20, 30]); out of memory "
                                              "(steps [40])")
    assert Ledger(workdir).exit_line([20, 30]).startswith("the verifier could not prove steps [20, 30]"), \
        "a later process reads the errors from the verdicts"
    assert ledger.exit_line([10]) == "failing verdicts for steps [10]", "steps no longer committed are not named"
