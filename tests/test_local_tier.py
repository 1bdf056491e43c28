"""The local tier (checkpointing/_src/local_tier.py): per-process copies on real disks, steps complete on every
process, restores only onto the layout that wrote them, damage on one process seen by all."""

import glob
import json
import os
import signal
import subprocess
import sys

import jax
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing.config import ConfigError
from checkpointing.errors import ManifestError
from checkpointing._src.local_tier import LocalLayoutMismatchError
from tests import helpers
from tests import local_tier_driver as driver

DRIVER = "tests.local_tier_driver"


def test_local_dir_template_expands_the_process_index():
    assert workdir_lib.expand_local_dir("/mnt/ram/run-{process}/x", 3) == "/mnt/ram/run-3/x"
    assert workdir_lib.expand_local_dir("/mnt/ram/run", 3) == "/mnt/ram/run"  # one disk per host
    with pytest.raises(ConfigError, match=r"unknown placeholder \{proc\}"):
        workdir_lib.expand_local_dir("/mnt/ram/{proc}", 0)


def test_manifest_names_its_tier_and_older_ones_read_as_persistent():
    fields = dict(step=1, leaves={}, fingerprints={}, losses={}, config={}, fixed_hash="h", fixed_fields={},
                  mesh={"data": 8}, reason="interval")
    persistent = manifest_lib.build(**fields)
    assert "tier" not in persistent and manifest_lib.tier(persistent) == manifest_lib.PERSISTENT
    local = manifest_lib.build(**fields, tier_fields={"tier": manifest_lib.LOCAL, "process_index": 0})
    assert manifest_lib.tier(local) == manifest_lib.LOCAL
    with pytest.raises(ManifestError, match="digest"):  # the tier is covered by the digest
        manifest_lib.validate({**local, "tier": manifest_lib.PERSISTENT})


def test_a_local_step_restores_only_onto_the_shards_that_wrote_it(tmp_path):
    """One process: the same layout restores bit for bit; another mesh, or the same mesh with another
    partitioning (this process would need shards it never wrote), is refused before any array is read."""
    mesh = driver.make_mesh()
    service = driver.open_local(str(tmp_path / "local-{process}"), mesh)
    service.save(5, driver.make_state(mesh, 5), losses={5: 1.0}, reason="interval")
    service.wait_until_finished()
    assert driver.shards_equal(service.restore(5, driver.abstract(mesh)).state, driver.make_state(mesh, 5))
    with pytest.raises(LocalLayoutMismatchError, match="on mesh data=2,model=4; this is .* on mesh data=4,model=2"):
        service.restore(5, driver.abstract(driver.make_mesh((4, 2))))
    moved = driver.abstract(mesh)
    moved["rows"] = jax.ShapeDtypeStruct(moved["rows"].shape, moved["rows"].dtype,
                                         sharding=NamedSharding(mesh, P(None, "model")))
    with pytest.raises(LocalLayoutMismatchError, match="holding other shards"):
        service.restore(5, moved)
    service.set_aside([5])  # every process moves its own copy (here, the only one)
    assert service.committed_steps() == [] and os.listdir(workdir_lib.superseded_dir(service.directory))
    service.close()


# --- a 2-process pod on 127.0.0.1 ------------------------------------------------------------------

def run_pod(*flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The launcher and its processes in a session of their own, all killed (by the group's id) if it hangs."""
    command = [sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=4",
               f"--module={DRIVER}", "--peer_exit_grace_secs=10", "--", *flags]
    proc = subprocess.Popen(command, env=helpers.subprocess_env(), cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, "")


def seen(out: str, phase: str, process: int) -> dict:
    with open(os.path.join(out, f"{phase}-{process}.json")) as f:
        return json.load(f)


def flip_chunk_byte(local_dir: str, step: int, key: bytes) -> None:
    """Flips one byte in the middle of one chunk's stored value (found in the OCDBT b-tree), so the
    arrays still decode and only the fingerprint can tell."""
    state = workdir_lib.step_dir(local_dir, step) / workdir_lib.STATE_ITEM
    kvstore = ts.KvStore.open({"driver": "file", "path": str(state) + "/"}).result()
    version = ts.ocdbt.dump(kvstore).result()["versions"][-1]
    assert version["root_height"] == 0, "a tiny state fits one b-tree node"
    entries = ts.ocdbt.dump(kvstore, version["root"]["location"]).result()["entries"]
    location = next(e["indirect_value"] for e in entries if e["key"] == key)  # value:<prefix>:<file>:<offset>:<len>
    prefix, data_file, offset, length = location.removeprefix("value:").split(":")
    with open(state / prefix / data_file, "r+b") as f:
        f.seek(int(offset) + int(length) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate_data_files(local_dir: str, step: int) -> None:
    for data_file in glob.glob(str(workdir_lib.step_dir(local_dir, step) / "**" / "d" / "*"), recursive=True):
        with open(data_file, "r+b") as f:
            f.truncate(8)


@pytest.mark.slow
def test_a_two_process_pod_keeps_complete_local_steps_and_refuses_damaged_or_foreign_ones(tmp_path):
    template, out = str(tmp_path / "local-{process}"), str(tmp_path / "out")
    local_dirs = [workdir_lib.expand_local_dir(template, process) for process in (0, 1)]
    result = run_pod(f"--local_dir={template}", f"--out={out}", "--phase=save")
    assert result.returncode == 0, result.stdout[-3000:]
    assert [seen(out, "save", p)["committed"] for p in (0, 1)] == [list(driver.STEPS)] * 2

    killed = [helpers.checkpoint_dir(d, f"{7 + p}.orbax-checkpoint-tmp-1700000000") for p, d in enumerate(local_dirs)]
    for path in killed:
        os.makedirs(os.path.join(path, workdir_lib.STATE_ITEM))
    flip_chunk_byte(local_dirs[1], 2, b"bias/c/0/0")  # a replicated leaf: process 0's copy stays intact
    truncate_data_files(local_dirs[1], 1)
    result = run_pod(f"--local_dir={template}", f"--out={out}", "--phase=check")
    assert result.returncode == 0, result.stdout[-3000:]
    checks = [seen(out, "check", p) for p in (0, 1)]
    assert not any(os.path.exists(path) for path in killed), "each process removes its own killed saves"
    for process, check in enumerate(checks):
        assert check["own"] == check["complete"] == [1, 2, 3, 4], process
        assert check["newest"] == {"step": 4, "equal": True}, process  # every shard it holds, bit for bit
        # Process 1 lost its copy of step 4: no process counts it, and step 3 is restored instead.
        assert check["complete_after_delete"] == [1, 2, 3], process
        assert check["after_delete"] == {"step": 3, "equal": True}, process
        # Damage on process 1 only: both processes raise the same typed error naming the step.
        assert check["flipped"]["error"] == "FingerprintMismatchError", (process, check["flipped"])
        assert "step 2" in check["flipped"]["message"], process
        assert check["truncated"]["error"] == "CorruptCheckpointError", (process, check["truncated"])
        assert "step 1" in check["truncated"]["message"], process
        assert check["other_mesh"]["error"] == "LocalLayoutMismatchError", process
        assert (f"saved by process {process} of 2 on mesh data=2,model=4; this is process {process} of 2 on mesh "
                "data=4,model=2") in check["other_mesh"]["message"]
    assert "leaf ['bias']" in checks[1]["flipped"]["message"]  # the process whose copy was damaged says where
    for damage in ("flipped", "truncated"):  # process 0's own copy was fine: it learnt of process 1's damage
        assert "process(es) 1 could not use their copy" in checks[0][damage]["message"]

    result = helpers.run_module(DRIVER, f"--local_dir={template}", f"--out={out}", "--phase=other_layout")
    assert result.returncode == 0, result.stderr[-3000:]
    other = seen(out, "other_layout", 0)
    assert other["complete"] == [1, 2, 3, 4]  # one process: its own listing (process 0's directory)
    assert other["restore"]["error"] == "LocalLayoutMismatchError"
    assert "saved by process 0 of 2 on mesh data=2,model=4; this is process 0 of 1" in other["restore"]["message"]
