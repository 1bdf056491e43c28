"""Faults of the verifier's own are `error`, never the checkpoint's `fail` (verifier/faults.py): a verifier
started without the user's package, a replay out of memory, a read error that outlasts the retries. Each
is written incomplete, the verifier exits 1 with one line naming the steps and the cause, and the next
verifier run, the fault gone, proves the same steps with no manual step. A transient read error is
retried and proves the step. Faults are real: a package missing from the path, XLA refusing an allocation,
EIO injected by strace."""

import os
import shutil

import pytest

from checkpointing._src import verdicts
from runtime import exit_codes
from tests import eio, helpers
from tests.tamper import RUN

pytestmark = pytest.mark.slow

PROGRAM = "mypkg.own_loop:replay_program"
# What a replay on devices too small for it meets: XLA refuses the allocation (RESOURCE_EXHAUSTED).
OUT_OF_MEMORY = '''

_replay_program = replay_program


def replay_program(config, mesh):
    program = _replay_program(config, mesh)
    program.batch_fn = lambda step: jnp.zeros((2 ** 42,), jnp.float32).block_until_ready()  # 16 TiB
    return program
'''


def with_package(root) -> str:
    return f"{root}{os.pathsep}{helpers.REPO_ROOT}"


def write_package(root, extra: str = "") -> None:
    """examples/own_loop.py as the user's own package `mypkg`, outside the repository."""
    package = root / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = open(os.path.join(helpers.REPO_ROOT, "examples", "own_loop.py")).read()
    assert "examples.own_loop:replay_program" in source
    (package / "own_loop.py").write_text(source.replace("examples.own_loop:replay_program", PROGRAM) + extra)


@pytest.fixture(scope="module")
def users_run(tmp_path_factory):
    """(the user's package root, a run of its loop: steps 20 and 40), trained once; tests copy the run."""
    root = tmp_path_factory.mktemp("user")
    write_package(root)
    workdir = str(root / "run")
    trained = helpers.run_module("mypkg.own_loop", f"--workdir={workdir}", "--mesh=data=4,model=2", "--steps=40",
                                 "--save_every_steps=20", PYTHONPATH=with_package(root))
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root, workdir


def verify(workdir: str, *flags: str, **env):
    return helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", *flags, device_count=2,
                              **env)


def states(workdir: str) -> dict[int, tuple[str, str, bool]]:
    return {step: (v["level"], v["status"], v["complete"]) for step, v in verdicts.read_all(workdir).items()}


def test_a_verifier_without_the_users_package_writes_errors_and_a_rerun_with_it_proves_them(users_run, tmp_path):
    root, trained = users_run
    workdir = str(tmp_path / "run")
    shutil.copytree(trained, workdir)
    before = helpers.committed_snapshot(workdir)
    line = (f"unproved: the verifier could not prove steps [20, 40]: program {PROGRAM}: cannot import it "
            "(ModuleNotFoundError: No module named 'mypkg') (0 of 2 committed steps proved, 0 failed, 2 unproved)")
    assert helpers.fault_line(verify(workdir, "--once"), exit_codes.UNPROVED) == line
    assert states(workdir) == {20: ("intact", "error", False), 40: ("intact", "error", False)}
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}")
    assert [row.split()[-2:] for row in table.stdout.splitlines()[2:]] == [["intact", "error"]] * 2, table.stdout
    # --follow tries each step once and ends with the run's final step: no step is retried in a loop.
    followed = verify(workdir, "--follow", "--poll_secs=0.1", "--max_poll_secs=0.2")
    assert helpers.fault_line(followed, exit_codes.UNPROVED) == line
    assert [followed.stderr.count(f"step {step}: the verifier could not prove it") for step in (20, 40)] == [1, 1]
    # The fault fixed, the next run proves them: nothing to delete by hand.
    proved = verify(workdir, "--once", PYTHONPATH=with_package(root))
    assert proved.returncode == 0, proved.stderr[-3000:]
    assert states(workdir) == {20: ("reproduced", "pass", True), 40: ("reproduced", "pass", True)}
    helpers.assert_committed_intact(before, workdir)


def test_a_replay_out_of_memory_is_an_error_and_the_next_run_proves_the_steps(users_run, tmp_path):
    root, trained = users_run
    workdir, short_of_memory = str(tmp_path / "run"), tmp_path / "short"
    shutil.copytree(trained, workdir)
    write_package(short_of_memory, OUT_OF_MEMORY)
    line = helpers.fault_line(verify(workdir, "--once", PYTHONPATH=with_package(short_of_memory)), exit_codes.UNPROVED)
    assert line.startswith("unproved: the verifier could not prove steps [20, 40]: out of memory on the verifier's "
                           "devices (RESOURCE_EXHAUSTED: "), line
    assert states(workdir) == {20: ("reproduced", "error", False), 40: ("reproduced", "error", False)}
    proved = verify(workdir, "--once", PYTHONPATH=with_package(root))
    assert proved.returncode == 0, proved.stderr[-3000:]
    assert states(workdir) == {20: ("reproduced", "pass", True), 40: ("reproduced", "pass", True)}


def verify_under_eio(tmp_path, workdir: str, files: list[str], *, until: str | None = None):
    """verifier.verify --once while the reads of `files` fail with EIO (tests/eio.py)."""
    return eio.run_under_eio(tmp_path, "verifier.verify", [f"--workdir={workdir}", "--mesh=data=8", "--once"], files,
                             until=until)


def test_a_lasting_eio_is_an_error_naming_the_step_and_the_next_run_proves_it(tmp_path, trained_copy):
    config = trained_copy(**RUN)
    before = helpers.committed_snapshot(config.workdir)
    result, injected = verify_under_eio(tmp_path, config.workdir, eio.array_files(config.workdir, [30]))
    assert injected >= 4, "the reads were not failed: the test proves nothing"
    path = helpers.checkpoint_dir(config.workdir, "30")
    line = helpers.fault_line(result, exit_codes.UNPROVED)
    assert line.startswith(f"unproved: the verifier could not prove steps [30]: step 30: reading its arrays from "
                           f"{path} failed 4 times: input/output error: {path}/state/"), line
    assert states(config.workdir) == {10: ("reproduced", "pass", True), 20: ("reproduced", "pass", True),
                                      30: ("intact", "error", False)}
    again = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=8", "--once")
    assert again.returncode == 0, again.stderr[-3000:]
    assert verdicts.read(config.workdir, 30)["level"] == "reproduced"
    assert verdicts.read(config.workdir, 30)["replayed_from"] == 20
    helpers.assert_committed_intact(before, config.workdir)


def test_a_transient_eio_is_retried_and_the_step_is_proved(tmp_path, trained_copy):
    config = trained_copy(**RUN)
    result, injected = verify_under_eio(tmp_path, config.workdir, eio.array_files(config.workdir, [30]),
                                        until="attempt 2 of 4")
    assert injected >= 1, "no read was failed: the test proves nothing"
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 30: reading its arrays from" in result.stderr and "attempt 2 of 4" in result.stderr
    assert states(config.workdir)[30] == ("reproduced", "pass", True)
