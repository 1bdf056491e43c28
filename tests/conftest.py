"""Eight fake CPU devices, set before JAX is imported anywhere in the test process."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag
) + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "conftest must run before anything imports jax"


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path / "run")
