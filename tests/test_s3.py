"""s3:// workdirs against a real S3 server on 127.0.0.1 (moto's, tests/s3_server.py, from the dev extra).

One server per module (conftest.s3_env), stopped by PID; boto3, s3fs and TensorStore reach it through the
standard AWS variables only (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from checkpointing._src import lease as lease_lib
from checkpointing._src import object_store
from checkpointing._src.lease_store import Conflict, open_store
from checkpointing._src.report import recorded_losses
from checkpointing._src.workdir import committed_steps, lease_dir
from checkpointing.errors import WorkdirLeasedError
from launch.pod import free_port
from runtime import exit_codes
from tests import helpers, s3_server
from tests.lease_records import contend
from trainer import models

TRAIN = ["--mesh=data=4,model=2", "--batch_size=32", "--save_every_steps=10", "--max_to_keep=100",
         "--log_every_steps=10"]
POD_STEPS = 60


def _objects(env: dict, prefix: str) -> dict[str, bytes]:
    """Every object under s3://BUCKET/prefix, read through boto3 (not through the code under test)."""
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=helpers.BUCKET, Prefix=prefix + "/")
    return {item["Key"]: client.get_object(Bucket=helpers.BUCKET, Key=item["Key"])["Body"].read()
            for page in pages for item in page.get("Contents", ())}


def _remove(env: dict, key: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"]).delete_object(
        Bucket=helpers.BUCKET, Key=key)


def _key(workdir: str) -> str:
    return object_store.split(workdir)[1]


# --- Orbax and TensorStore see s3:// as gs:// -------------------------------------------------------

def test_orbax_writes_s3_arrays_through_tensorstores_s3_driver_and_commits_by_a_marker(monkeypatch):
    """What orbax_s3._s3_as_gcs relies on (Orbax 0.12's private names) and what it gives: the s3 driver
    with the endpoint and region from the standard variables, and the commit marker instead of a rename."""
    from orbax.checkpoint._src.path import atomicity, atomicity_defaults
    from orbax.checkpoint._src.serialization import tensorstore_utils
    from etils import epath

    from checkpointing._src import orbax_s3  # noqa: F401  (installs the hooks)

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    spec = tensorstore_utils.build_kvstore_tspec("s3://bucket/run/checkpoints/10/state", use_ocdbt=True)
    assert spec["driver"] == "ocdbt"
    assert spec["base"] == {"driver": "s3", "bucket": "bucket", "path": "run/checkpoints/10/state",
                            "aws_region": "eu-west-3", "endpoint": "http://127.0.0.1:9",
                            "aws_credentials": {"type": "environment"}}
    write = tensorstore_utils.OcdbtKvStoreWriteOptions(mode=tensorstore_utils.OcdbtWriteMode.WRITE)
    written = tensorstore_utils.build_kvstore_tspec("s3://bucket/run", use_ocdbt=True, ocdbt_write_options=write)
    assert written["target_data_file_size"] == 400 * 2**20, written  # GCS's, not the local disk's 2 GiB
    gcs = tensorstore_utils.build_kvstore_tspec("gs://bucket/run/checkpoints/10/state", use_ocdbt=True)
    assert gcs["base"] == {"driver": "gcs", "bucket": "bucket", "path": "run/checkpoints/10/state"}
    default = atomicity_defaults.get_default_temporary_path_class
    assert default(epath.Path("s3://bucket/run/checkpoints")) is atomicity.CommitFileTemporaryPath
    assert default(epath.Path("gs://bucket/run/checkpoints")) is atomicity.CommitFileTemporaryPath
    assert default(epath.Path("/tmp/run/checkpoints")) is atomicity.AtomicRenameTemporaryPath


def test_only_object_store_urls_and_local_paths_are_workdirs():
    from checkpointing.config import ConfigError, resolve_path

    assert resolve_path("s3://bucket/run", "--workdir") == "s3://bucket/run"
    for bad in ("s3a://bucket/run", "az://bucket/run", "s3:///run"):
        with pytest.raises(ConfigError, match="not a local path, gs://BUCKET/PATH or s3://BUCKET/PATH"):
            resolve_path(bad, "--workdir")


# --- the acceptance run: a pod on S3, SIGKILLed after a commit, resumed on 4 processes, verified ------

def _pod(num_processes: int, devices_per_process: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "launch.local", f"--num_processes={num_processes}",
            f"--devices_per_process={devices_per_process}", "--peer_exit_grace_secs=10", "--", *flags]


def _run_pod(num_processes: int, devices_per_process: int, *flags: str, env: dict | None = None):
    return subprocess.run(_pod(num_processes, devices_per_process, *flags), cwd=helpers.REPO_ROOT,
                          env=helpers.subprocess_env(**(env or {})), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_pod_on_s3_killed_after_a_commit_resumes_on_four_processes_and_every_step_is_proved(s3_env, tmp_path):
    from checkpointing._src import verdicts

    local = str(tmp_path / "uninterrupted")
    reference = _run_pod(2, 4, f"--workdir={local}", f"--steps={POD_STEPS}", *TRAIN)
    assert reference.returncode == 0, reference.stdout[-3000:]
    uninterrupted = recorded_losses(local)

    workdir = helpers.s3_workdir("pod")
    flags = [f"--workdir={workdir}", f"--steps={POD_STEPS}", *TRAIN]
    log = open(tmp_path / "killed.log", "w")
    launcher = subprocess.Popen(_pod(2, 4, *flags), cwd=helpers.REPO_ROOT, env=helpers.subprocess_env(**s3_env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not committed_steps(workdir) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher.poll() is None, "the pod ended before it could be killed after a commit"
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and both trainers: a lost machine
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
        log.close()
    killed_at = committed_steps(workdir)
    assert killed_at and killed_at[-1] < POD_STEPS, killed_at

    resumed = _run_pod(4, 2, *flags[:-len(TRAIN)], *TRAIN[1:], "--mesh=data=8", env=s3_env)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resumed from step {killed_at[-1]}" in resumed.stdout, resumed.stdout[-3000:]
    losses = recorded_losses(workdir)
    assert sorted(losses) == list(range(POD_STEPS))
    head = range(killed_at[-1])
    assert {s: losses[s] for s in head} == {s: uninterrupted[s] for s in head}, "the same 2 x 4 layout: bit-exact"
    tail = range(killed_at[-1], POD_STEPS)
    difference = helpers.max_relative_difference({s: losses[s] for s in tail}, {s: uninterrupted[s] for s in tail})
    assert difference <= models.resolve("mlp").cross_mesh_loss_rtol, difference  # NaN fails too

    verify = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                device_count=2, **s3_env)
    assert verify.returncode == 0, verify.stderr[-3000:]
    found = verdicts.read_all(workdir)
    assert sorted(found) == committed_steps(workdir) == list(range(10, POD_STEPS + 1, 10))
    assert all((v["level"], v["status"]) == ("reproduced", "pass") for v in found.values()), found
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}", **s3_env)
    assert table.returncode == 0, table.stderr[-2000:]
    rows = table.stdout.strip().splitlines()[2:]
    assert [row.split()[0] for row in rows] == [str(s) for s in found]
    assert all("reproduced pass" in row for row in rows), table.stdout
    plot = helpers.run_module("trainer.inspect", f"--workdir={workdir}", f"--plot={workdir}/run.png", **s3_env)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert _objects(s3_env, _key(workdir))[f"{_key(workdir)}/run.png"].startswith(b"\x89PNG"), "a PNG, on S3"

    # --init_from an s3:// step: its params, read through TensorStore's s3 driver, are the reference's leaf
    # for leaf (step 10: the same 2 x 4 layout), and a new run records where it started.
    from checkpointing import restore_subtree
    from checkpointing._src.workdir import read_manifest
    from trainer import loop
    from trainer.program import build_mesh, build_program

    config = helpers.small_config(str(tmp_path / "from-s3"), steps=10, save_every_steps=10,
                                  init_from=f"{workdir}:10")
    abstract = build_program(config, build_mesh(config)).abstract_state.params
    imported, _ = restore_subtree(workdir, 10, "params", abstract)
    assert helpers.leaves_equal(imported, restore_subtree(local, 10, "params", abstract)[0])
    loop.train(config)
    assert read_manifest(config.workdir, 10)["init_from"] == {
        "workdir": workdir, "step": 10, "digest": read_manifest(workdir, 10)["digest"]}


@pytest.mark.slow
def test_a_following_verifier_started_before_the_run_proves_every_step_the_run_commits_on_s3(s3_env, tmp_path):
    """`verify --follow` on an s3:// workdir that does not exist yet: S3 has no directory times to watch, so
    it lists on its backoff, and proves each step the trainer commits, then exits 0 at the final one."""
    from checkpointing._src import verdicts

    workdir = helpers.s3_workdir("follow")
    log_path = tmp_path / "verifier.log"
    with helpers.started_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--follow",
                                "--poll_secs=0.2", "--max_poll_secs=1", device_count=2, log_path=str(log_path),
                                **s3_env) as verifier:
        trained = helpers.run_module("trainer.train", f"--workdir={workdir}", "--steps=30", *TRAIN, **s3_env)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert verifier.wait(timeout=240) == 0, log_path.read_text()[-3000:]
    assert [(s, v["level"], v["status"]) for s, v in verdicts.read_all(workdir).items()] == [
        (10, "reproduced", "pass"), (20, "reproduced", "pass"), (30, "reproduced", "pass")]


# --- one writer per workdir: the lease on S3's conditional writes -----------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures("no_job_id")
def test_the_lease_on_s3_refuses_a_second_holder_and_of_racing_writers_exactly_one_wins(s3_env):
    workdir = helpers.s3_workdir("lease")
    first = lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-a", 1, None))
    try:
        with pytest.raises(WorkdirLeasedError, match=r"is leased to another writer \(host node-a pid 1 job none "):
            lease_lib.acquire(workdir, 60, identity=lease_lib.Identity("node-b", 2, None))
        store = open_store(lease_dir(workdir))
        text, etag = store.read(first.generation)
        first.renew()  # If-Match on the ETag it read: accepted, and the ETag changes
        first.check()
        with pytest.raises(Conflict):  # a writer holding the old ETag is refused (412)
            store.replace(first.generation, text, etag)
        with pytest.raises(Conflict):  # If-None-Match: * on an existing record
            store.create(first.generation, text)
        assert lease_lib.holder(workdir).token == first.record.token
    finally:
        first.release()
    for round_ in range(3):  # eight writers race for the next generation, three times
        after = lease_lib._newest(open_store(lease_dir(workdir)))[0]
        won = contend(workdir, after_generation=after)
        try:
            assert len(won) == 1, f"round {round_}: {len(won)} writers took generation {after + 1}"
            assert lease_lib.holder(workdir).token == won[0].record.token
        finally:
            for lease in won:
                lease.release()


@pytest.mark.slow
@pytest.mark.usefixtures("no_job_id")
def test_a_store_that_ignores_conditional_writes_is_refused_before_anything_is_saved(s3_env):
    """An S3-compatible store without If-None-Match (the S3 server told to drop it) cannot keep two writers
    apart: the first claim finds out by writing its record twice, and the trainer exits 1 with one line."""
    workdir = helpers.s3_workdir("unconditional")
    s3_server.honour_conditions(s3_env["AWS_ENDPOINT_URL"], False)
    try:
        result = helpers.run_module("trainer.train", f"--workdir={workdir}", "--mesh=data=2", "--batch_size=32",
                                    "--steps=10", device_count=2, timeout=120, **s3_env)
    finally:
        s3_server.honour_conditions(s3_env["AWS_ENDPOINT_URL"], True)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line.startswith(f"error: cannot take the lease in {workdir}/lease: {workdir}/lease: the store accepted "
                           "a second 'If-None-Match: *' write"), line
    assert not [key for key in _objects(s3_env, _key(workdir)) if "/lease/" not in key], "nothing but the lease"


# --- faults: an unreachable endpoint, refused credentials, throttling and dropped connections -------

@pytest.mark.slow
@pytest.mark.parametrize("module, flags", [
    ("trainer.inspect", []),
    ("verifier.verify", ["--mesh=data=2", "--once"]),
    ("trainer.train", ["--mesh=data=2", "--batch_size=32", "--steps=10"]),
])
def test_an_unreachable_s3_endpoint_is_one_line_naming_it_within_the_storage_timeout(module, flags):
    """Refused connections are retried with random backoff (4-12 s in four tries here, now and then under
    3 s): the line comes either from the timeout or from the refusal once those retries are spent."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**s3_server.client_env(url)}
    result = helpers.run_module(module, "--workdir=s3://bucket/run", "--storage_timeout_secs=3", *flags,
                                device_count=2, timeout=120, **env)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line in (f"error: --workdir=s3://bucket/run: endpoint {url} unreachable (no answer within 3s)",
                    f"error: --workdir=s3://bucket/run: endpoint {url} unreachable"), line
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module, flags", [
    ("trainer.train", ["--mesh=data=2", "--batch_size=32", "--steps=10"]),
    ("verifier.verify", ["--mesh=data=2", "--once"]),
])
def test_refused_credentials_are_one_line_and_nothing_is_written(s3_env, module, flags):
    workdir = helpers.s3_workdir("refused")
    result = helpers.run_module(module, f"--workdir={workdir}", *flags, device_count=2, timeout=120,
                                **{**s3_env, "AWS_ACCESS_KEY_ID": "not-a-key"})
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert line == f"error: --workdir={workdir}: credentials refused", line
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr
    assert _objects(s3_env, _key(workdir)) == {}


@pytest.mark.slow
def test_throttling_and_dropped_connections_are_retried_never_a_corrupt_step_or_a_verdict(s3_env, trained_runs):
    """503 SlowDown and connections closed without an answer, on the writes of every save (TensorStore's
    arrays, s3fs's metadata and commit marker) and then on the reads of a resume: each is retried, the
    run ends as an uninterrupted one does, and every step restores with its fingerprints and is proved."""
    from checkpointing._src import verdicts

    url = s3_env["AWS_ENDPOINT_URL"]
    workdir = helpers.s3_workdir("faults")
    under = re.escape(f"/{helpers.BUCKET}/{_key(workdir)}/checkpoints/")
    # {(method, which objects): (503s, drops)}: TensorStore's OCDBT files under state/; s3fs's Orbax metadata,
    # manifest and commit marker. Met in a row by one request: TensorStore backs off 1 s, 2 s, 4 s.
    injected = {("PUT", r".*/state/ocdbt\.process_0/"): (2, 1), ("PUT", r".*/_CHECKPOINT_METADATA"): (2, 0),
                ("PUT", r".*/commit_success\.txt"): (0, 1), ("GET", r".*/state/"): (2, 1),
                ("GET", r".*/manifest/metadata"): (1, 1)}

    def inject(method: str) -> None:
        for (verb, what), (slow_downs, drops) in injected.items():
            if verb == method:
                s3_server.inject(url, count=slow_downs, status=503, match=f"^{verb} {under}{what}")
                s3_server.inject(url, count=drops, status=None, match=f"^{verb} {under}{what}")

    s3_server.request_log(url, clear=True)
    flags = [f"--workdir={workdir}", *helpers.SMALL_FLAGS, "--max_to_keep=100"]
    inject("PUT")
    first = helpers.run_module("trainer.train", *flags, "--steps=20", **s3_env)
    assert first.returncode == 0, first.stderr[-3000:]
    inject("GET")
    resumed = helpers.run_module("trainer.train", *flags, "--steps=30", **s3_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 20" in resumed.stderr
    answered = [(r["method"], f"/{helpers.BUCKET}/{r['name']}", r["status"]) for r in s3_server.request_log(url)]
    for (verb, what), (slow_downs, drops) in injected.items():  # every fault was met, then retried
        met = [status for method, name, status in answered if method == verb and re.match(f"{under}{what}", name)]
        assert (met.count(503), met.count(0)) == (slow_downs, drops), (verb, what, met)
        assert 200 in met or 206 in met, (verb, what, met)
    assert committed_steps(workdir) == [10, 20, 30]
    reference = recorded_losses(trained_runs(**helpers.SHARED_RUN, steps=30))
    assert recorded_losses(workdir) == reference
    verify = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                device_count=2, **s3_env)
    assert verify.returncode == 0, verify.stderr[-3000:]
    assert [(s, v["status"]) for s, v in verdicts.read_all(workdir).items()] == [(10, "pass"), (20, "pass"),
                                                                                  (30, "pass")]
    # The verifier's reads meet them too: retried, never a verdict's evidence.
    for verdict in verdicts.read_all(workdir):
        _remove(s3_env, f"{_key(workdir)}/verdicts/{verdict}.json")
    s3_server.request_log(url, clear=True)
    s3_server.inject(url, count=2, status=503, match=f"^GET {under}.*/state/")
    s3_server.inject(url, count=1, status=None, match=f"^GET {under}.*/state/")
    again = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                               device_count=2, **s3_env)
    assert again.returncode == 0, again.stderr[-3000:]
    met = [r["status"] for r in s3_server.request_log(url) if r["method"] == "GET" and "/state/" in r["name"]]
    assert (met.count(503), met.count(0)) == (2, 1), met
    assert [(s, v["status"]) for s, v in verdicts.read_all(workdir).items()] == [(10, "pass"), (20, "pass"),
                                                                                  (30, "pass")]
    # A step whose commit marker is missing (its save killed before the marker) is never listed, by a fresh
    # process that has loaded nothing but the listing, nor by inspect.
    _remove(s3_env, f"{_key(workdir)}/checkpoints/30/commit_success.txt")
    listing = helpers.run_python("from checkpointing._src.workdir import committed_steps\n"
                                 f"print(committed_steps({workdir!r}))", **s3_env)
    assert listing.returncode == 0 and listing.stdout.strip() == "[10, 20]", listing.stdout + listing.stderr[-2000:]
    table = helpers.run_module("trainer.inspect", f"--workdir={workdir}", **s3_env)
    assert [row.split()[0] for row in table.stdout.strip().splitlines()[2:]] == ["10", "20"], table.stdout


@pytest.mark.slow
def test_a_write_s3_refuses_mid_run_is_one_line_naming_step_path_and_cause_and_the_last_commit_stays(s3_env):
    """AccessDenied (403, not retried) on every write of step 20: the trainer exits 1 with one line naming
    the step, its path and the cause; step 10 stays the latest committed step and restores as saved."""
    url = s3_env["AWS_ENDPOINT_URL"]
    workdir = helpers.s3_workdir("denied")
    step_20 = re.escape(f"/{helpers.BUCKET}/{_key(workdir)}/checkpoints/20")
    s3_server.inject(url, count=1000, status=403, match=f"^PUT {step_20}/")  # this run's step 20 only
    result = helpers.run_module("trainer.train", f"--workdir={workdir}", *helpers.SMALL_FLAGS, "--max_to_keep=100",
                                "--steps=30", **s3_env)
    line = helpers.fault_line(result, exit_codes.FAILURE)
    assert "step 20" in line and f"{workdir}/checkpoints/20" in line and "permission denied" in line, line
    assert committed_steps(workdir) == [10]
    verify = helpers.run_module("verifier.verify", f"--workdir={workdir}", "--mesh=data=2", "--once",
                                device_count=2, **s3_env)
    assert verify.returncode == 0, verify.stderr[-3000:]
