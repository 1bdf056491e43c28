"""docker/Dockerfile built and run for real (tests/image.py says how, with podman, here).

The image is built once per session from the checkout, as a user builds it (the CPU build
argument; only the base is a stand-in). Then, through the image's entry point, as its non-root
USER and with no network: a short run is trained, SIGKILLed after its first commit, resumed on
another mesh and preempted there by SIGTERM (exit 75), resumed again to the end, and proved by
the image's own verifier; its loss list must equal the same run's outside the image. A Dockerfile
that breaks (a package the entry point imports not copied, an install that fails) fails here.

Needs root, podman and debootstrap. Without them the tests skip and say why, except under CI
(CI=true), where they fail: .ci/run installs both.
"""

import logging
import os
import re
import signal
import time

import pytest

from checkpointing._src import compare, verdicts
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, read_manifest
from runtime import exit_codes
from tests import helpers, image
from trainer import models

STEPS = 100
TRAIN_FLAGS = [f"--steps={STEPS}", "--save_every_steps=10", "--max_to_keep=100", "--batch_size=32",
               "--log_every_steps=5"]
FIRST_MESH, SECOND_MESH = "--mesh=data=4,model=2", "--mesh=data=8"
# The first test to run also builds the image: about 1.5 minutes on a fresh machine, more on a slow
# network; pytest-timeout counts fixture set-up in the test's time.
BUILD_TIMEOUT_SECS = 900
JAX_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
IMAGE_WORKDIR = "/tmp/run"  # the host sees it as <the test's tmp>/run


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The image of this checkout, built (podman's layer cache makes a rebuild of an unchanged tree
    quick); its build seconds and size are logged."""
    reason = image.missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the image, but {reason}")
        pytest.skip(f"cannot build the image here: {reason}")
    seconds = image.build(str(tmp_path_factory.mktemp("image") / "build.log"), timeout=BUILD_TIMEOUT_SECS)
    size = image.inspect()["Size"]
    logging.warning("image %s built in %.0f s; %.2f GB", image.TAG, seconds, size / 1e9)
    return size


@pytest.fixture
def container(built, tmp_path):
    """The built image, mounted; its commands see <tmp_path>/tmp as /tmp, writable by its USER."""
    host_tmp, layers = tmp_path / "tmp", tmp_path / "layers"
    host_tmp.mkdir()
    layers.mkdir()
    host_tmp.chmod(0o1777)
    with image.mounted(str(host_tmp), str(layers)) as mounted:
        yield mounted


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_SECS + 300)
def test_the_image_runs_as_a_non_root_user_without_network_and_passes_exit_codes_through(container):
    probe = container.run("python", "-c", "import os, socket; print(os.getuid(), os.getcwd(), socket.if_nameindex())")
    assert probe.returncode == 0, probe.stderr[-3000:]
    uid, cwd, interfaces = probe.stdout.split(maxsplit=2)
    assert int(uid) != 0 and int(uid) == container.user_ids()[0], probe.stdout  # the image's USER, not root
    assert cwd == "/app", probe.stdout
    assert interfaces.strip() == "[(1, 'lo')]", interfaces  # a network namespace of its own: loopback only
    # The entry point's own refusal and the trainer's bad-input code both come out as they are.
    assert container.run().returncode == 0  # CMD ["help"]
    assert container.run("trian").returncode == exit_codes.BAD_INPUT
    bad = container.run("train", "--workdir=/tmp/x", "--steps=0", **JAX_ENV)
    assert bad.returncode == exit_codes.BAD_INPUT, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("error: "), bad.stderr[-3000:]


def _wait(predicate, proc, log_path: str, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the trainer ended before {what}:\n{open(log_path).read()[-3000:]}"
    assert predicate(), f"timed out waiting for {what}:\n{open(log_path).read()[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_SECS + 600)
def test_the_image_trains_is_killed_resumes_on_another_mesh_is_preempted_and_proved(container, tmp_path):
    workdir, reference = str(tmp_path / "tmp" / "run"), str(tmp_path / "uninterrupted")
    train = ("train", f"--workdir={IMAGE_WORKDIR}", *TRAIN_FLAGS)
    logs = {name: str(tmp_path / f"{name}.log") for name in ("reference", "killed", "preempted")}
    with helpers.started_module("trainer.train", f"--workdir={reference}", *TRAIN_FLAGS, FIRST_MESH,
                                log_path=logs["reference"]) as uninterrupted:
        # 1. Trained in the image on 4x2, SIGKILLed as soon as one checkpoint is committed.
        with container.started(*train, FIRST_MESH, log_path=logs["killed"], **JAX_ENV) as proc:
            _wait(lambda: committed_steps(workdir), proc, logs["killed"], "its first commit")
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        killed_at = committed_steps(workdir)[-1]
        assert killed_at < STEPS, "killed mid-run"
        # 2. Resumed on data=8; SIGTERM to the entry point's process once it has committed a step of
        # its own: the preemption save commits and the trainer's 75 is the command's exit code.
        with container.started(*train, SECOND_MESH, log_path=logs["preempted"], **JAX_ENV) as proc:
            _wait(lambda: committed_steps(workdir)[-1] > killed_at, proc, logs["preempted"], "a commit on data=8")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == exit_codes.PREEMPTED, open(logs["preempted"]).read()[-3000:]
        preempted_at = committed_steps(workdir)[-1]
        assert read_manifest(workdir, preempted_at)["reason"] == "preemption"
        assert preempted_at < STEPS, "preempted mid-run"
        # 3. Resumed again, to the end.
        finished = container.run(*train, SECOND_MESH, **JAX_ENV)
        assert finished.returncode == 0, finished.stderr[-3000:]
        assert uninterrupted.wait(timeout=300) == 0, open(logs["reference"]).read()[-3000:]
    # 4. The image's own verifier, on its own 2 devices, proves every step.
    proved = container.run("verify", f"--workdir={IMAGE_WORKDIR}", "--mesh=data=2", "--once",
                           XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    assert proved.returncode == 0, proved.stderr[-3000:]
    steps = committed_steps(workdir)
    assert steps[-1] == STEPS and read_manifest(workdir, STEPS)["mesh"] == {"data": 8, "model": 1}
    found = verdicts.read_steps(workdir, steps)
    assert {step: found[step]["level"] for step in steps} == dict.fromkeys(steps, "reproduced"), found
    assert all(verdict["status"] == "pass" for verdict in found.values()), found
    # Written by the image's USER, not by root.
    assert os.stat(helpers.checkpoint_dir(workdir, str(STEPS))).st_uid == container.user_ids()[0]

    # The whole loss list equals the run outside the image: bit for bit up to the first resume
    # (same 4x2 layout, same jaxlib), within the model's cross-mesh tolerance after it (data=8).
    resumed, expected = recorded_losses(workdir), recorded_losses(reference)
    assert list(resumed) == list(expected) == list(range(STEPS))
    mismatch, largest = compare.compare_losses(resumed, expected, models.resolve("mlp").cross_mesh_loss_rtol)
    assert mismatch is None, mismatch.detail
    before = {step: expected[step] for step in range(killed_at)}
    assert compare.compare_losses(resumed, before, 0.0)[0] is None
    assert expected[STEPS - 1] < expected[0], "the loss must fall"
    logging.warning("image run: killed at %d, preempted at %d (exit 75), finished and proved; losses of %d steps "
                    "equal the host's (bit-exact to %d, then max relative difference %.2e)",
                    killed_at, preempted_at, STEPS, killed_at, largest)


def test_the_stand_in_base_is_the_dockerfiles_base():
    """The build finds its FROM only under the stand-in's name (it never pulls), and the stand-in is
    Debian bookworm's own Python, 3.11: a Dockerfile moved to another base needs another stand-in."""
    dockerfile = open(os.path.join(helpers.REPO_ROOT, "docker", "Dockerfile")).read()
    [base] = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert image.BASE == f"localhost/{base}" == "localhost/python:3.11-slim-bookworm", base
