"""Eight fake CPU devices, set before JAX is imported anywhere in the test process; shared fixtures."""

import contextlib
import os

os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag
) + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import importlib.util  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

from tests import helpers  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "conftest must run before anything imports jax"


@pytest.fixture(autouse=True)
def absl_log_level():
    """Parsing absl flags in-process (tests/test_config.py, helpers.run_in_process) sets absl's logger
    to --verbosity's level; later tests reading INFO records with caplog must not depend on order."""
    from absl import logging as absl_logging

    level = absl_logging.get_absl_logger().level
    yield
    absl_logging.get_absl_logger().setLevel(level)


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture
def no_job_id(monkeypatch):
    """No scheduler job id in this process's environment (nor, through helpers.subprocess_env, in the
    trainers it starts): with one, every trainer of a lease test would be "the same job"."""
    from checkpointing._src import lease as lease_lib

    for name in lease_lib.JOB_ID_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """trained_runs(**overrides) -> the workdir of loop.train(helpers.small_config(.., **overrides)),
    trained once per session for each distinct set of overrides. Read only: tests use `trained_copy`."""
    from trainer import loop

    runs: dict[tuple, str] = {}

    def run(**overrides) -> str:
        key = tuple(sorted(overrides.items()))
        if key not in runs:
            workdir = str(tmp_path_factory.mktemp("trained") / "run")
            loop.train(helpers.small_config(workdir, **overrides))
            runs[key] = workdir
        return runs[key]

    return run


@pytest.fixture
def trained_copy(trained_runs, tmp_path):
    """trained_copy(dest=None, **overrides) -> the config of a fresh copy of that trained run at `dest`
    (default <tmp_path>/run), the test's own to change."""

    def copy(dest: str | None = None, **overrides):
        dest = dest or str(tmp_path / "run")
        shutil.copytree(trained_runs(**overrides), dest)
        return helpers.small_config(dest, **overrides)

    return copy


@pytest.fixture(scope="module")
def gcs_env():
    """A GCS-protocol server on 127.0.0.1 (tests/gcs_emulator.py), stopped by PID: the environment
    that points TensorStore and gcsfs at it, also set in os.environ while the module runs."""
    if importlib.util.find_spec("gcp_storage_emulator") is None or importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcp-storage-emulator and gcsfs are not installed (pip install -e .[dev]); CI installs them")
    from tests import gcs_emulator

    server, env = gcs_emulator.start(helpers.BUCKET, cwd=helpers.REPO_ROOT, env=helpers.subprocess_env())
    try:
        with _environ(env):  # for the in-process reads of the tests (gcsfs, epath)
            yield env
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_env():
    """An S3 server on 127.0.0.1 (moto's, tests/s3_server.py), stopped by PID: the standard AWS variables
    that point boto3, s3fs and TensorStore at it, also set in os.environ while the module runs. moto comes
    with the dev extra, so CI runs these tests; a missing one fails here instead of skipping."""
    from tests import s3_server

    server, env = s3_server.start(helpers.BUCKET, cwd=helpers.REPO_ROOT, env=helpers.subprocess_env())
    try:
        with _environ(env):  # for the in-process reads of the tests (s3fs, epath, the lease store)
            _forget_s3_clients()
            yield env
    finally:
        _forget_s3_clients()
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """os.environ with `env` set inside, as it was outside."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget_s3_clients() -> None:
    """s3fs clients read the endpoint when made, and fsspec and etils.epath keep them for the process: a
    later module's server is on another port. (A trainer's endpoint does not move while it runs.)"""
    import s3fs
    from etils.epath import backend

    s3fs.S3FileSystem.clear_instance_cache()
    type(backend.fsspec_backend)._get_filesystem.cache_clear()


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """A small real corpus (tests/test_records_train*.py): trainer.prepare over the first 6 stdlib files,
    bytes, 32-token examples, ~270 train records in 3 shards (an epoch is ~8 steps of 32) and 84 eval."""
    from trainer.input import corpus, shards

    out = str(tmp_path_factory.mktemp("corpus") / "stdlib")
    shards.prepare(corpus.default_corpus_dir(), out, 32, eval_fraction=0.25, max_files=6, records_per_shard=100)
    return out


@pytest.fixture
def restored_steps(monkeypatch):
    """Every step CheckpointService.restore is asked for, in order (the real restore runs)."""
    from checkpointing._src.service import CheckpointService  # noqa: PLC0415  (only the tests that ask load Orbax)

    restored, real_restore = [], CheckpointService.restore
    monkeypatch.setattr(CheckpointService, "restore", lambda self, step, *args, **kwargs: restored.append(step) or
                        real_restore(self, step, *args, **kwargs))
    return restored
