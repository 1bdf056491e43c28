"""Object stores against a local disk: one save and one restore of the same state through the service, on a
local disk, on the GCS-protocol server (tests/gcs_emulator.py) and on the S3 server (tests/s3_server.py, moto),
both on 127.0.0.1 and in memory; the seconds as ratios to the local disk's, measured in the same run, and the
requests each server answered for one save and for one restore. Then, on s3://, the directory client measured:
a reader's pass over checkpoints/ through s3fs (etils.epath, as Orbax and the service use it) and through boto3.

The state is benchmarks.checkpoint_state's (--state_gib of float32 arrays fully sharded over data=4,model=2 of 8
fake CPU devices). Each sample saves a fresh step (save + wait until committed) and restores it onto the same
layout (fingerprints checked, as every restore does); the stores take turns in an order rotated each sample, the
first sample is not kept. Both servers are Python, on the same 2 cores as the benchmark: their absolute speed is
theirs, not GCS's or S3's; the request counts are the protocol's and carry over.

  PYTHONPATH=. .venv/bin/python -m benchmarks.store_bench [--state_gib=1] [--samples=3] [--json_out=FILE]
"""

import collections
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

from absl import flags

from benchmarks import common

os.environ.update({k: v for k, v in common.child_env(8).items() if k in ("XLA_FLAGS", "JAX_PLATFORMS")})  # before JAX

from benchmarks import checkpoint_state  # noqa: E402  (imports JAX)
from runtime import entry  # noqa: E402

_SAMPLES = flags.DEFINE_integer("samples", 3, "Measured samples per store (one more, first, is not kept).",
                                lower_bound=1)
_STORES = flags.DEFINE_list("stores", ["local", "gs", "s3"], "Stores to measure; 'local' is the baseline.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results to this file as JSON.")

BUCKET = "store-bench"
RUN_FIELDS = {"config": {"bench": True}, "fixed_fields": {}, "fixed_hash": "bench", "mesh": {"data": 4, "model": 2}}
OPS = ("write", "read", "list", "get", "head", "delete", "copy", "other")


class Store:
    """One store: its workdir root, and (for a server) its process and request log."""

    def __init__(self, name: str, local_root: str):
        self.name, self.process, self._log = name, None, None
        if name == "local":
            self.root = os.path.join(local_root, "bench")
            return
        from tests import gcs_emulator, s3_server  # benchmarks may use the tests' servers

        server = {"gs": gcs_emulator, "s3": s3_server}[name]
        self.process, env = server.start(BUCKET, cwd=common.ROOT, env=common.child_env(1), new_session=True)
        os.environ.update(env)
        url = env.get("AWS_ENDPOINT_URL") or env["STORAGE_EMULATOR_HOST"]
        self._log = lambda clear: server.request_log(url, clear=clear)
        self.root = f"{name}://{BUCKET}/bench"

    def requests(self, clear: bool = True) -> dict[str, int]:
        if self._log is None:
            return {}
        counts = collections.Counter(entry["op"] for entry in self._log(clear))
        return {op: counts[op] for op in OPS if counts[op]} | {"total": sum(counts.values())}

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def one_sample(store: Store, sample: int, state, target) -> dict:
    import jax

    from checkpointing import CheckpointConfig
    from checkpointing._src.service import CheckpointService, RunMetadata

    workdir = f"{store.root}/{sample}"
    service = CheckpointService(workdir, CheckpointConfig(async_save=True, max_to_keep=1),
                                run=RunMetadata(**RUN_FIELDS))
    store.requests()  # the service's opening is not the save's
    started = time.perf_counter()
    service.save(1, state, losses={}, reason="interval")
    service.wait_until_finished()
    save_secs = time.perf_counter() - started
    save_requests = store.requests()
    started = time.perf_counter()
    restored = jax.block_until_ready(service.restore(1, target).state)
    restore_secs = time.perf_counter() - started
    restore_requests = store.requests()
    service.close()
    del restored
    from etils import epath

    epath.Path(workdir).rmtree()  # untimed: the servers hold every object in memory
    return {"save": save_secs, "restore": restore_secs, "save_requests": save_requests,
            "restore_requests": restore_requests}


def directory_clients(store: Store, steps: int = 3, passes: int = 20) -> dict[str, dict]:
    """A reader's pass over an s3:// checkpoints/ (list the steps, check each one's commit marker, read the
    newest manifest) through s3fs (etils.epath, which Orbax uses) and through boto3, taking turns: the
    choice of the directory client, measured. {client: {"ms": median, "requests": per pass}}."""
    import boto3

    from checkpointing._src import object_store
    from checkpointing._src.workdir import fresh_path

    root = f"{store.root}/clients/checkpoints"
    bucket, prefix = object_store.split(root)
    client = boto3.client("s3")
    for step in range(1, steps + 1):
        for name in ("commit_success.txt", "manifest/metadata", "state/_METADATA"):
            client.put_object(Bucket=bucket, Key=f"{prefix}/{step}/{name}", Body=b"{}" * 512)

    def with_s3fs() -> None:
        found = sorted(fresh_path(root).iterdir(), key=lambda path: int(path.name))
        committed = [path for path in found if (path / "commit_success.txt").exists()]
        (committed[-1] / "manifest" / "metadata").read_text()

    def with_boto3() -> None:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", Delimiter="/")
        found = sorted(int(entry["Prefix"].rstrip("/").rsplit("/", 1)[1]) for entry in listed["CommonPrefixes"])
        committed = [step for step in found
                     if client.head_object(Bucket=bucket, Key=f"{prefix}/{step}/commit_success.txt")]
        client.get_object(Bucket=bucket, Key=f"{prefix}/{committed[-1]}/manifest/metadata")["Body"].read()

    seconds: dict[str, list[float]] = {"s3fs": [], "boto3": []}
    requests: dict[str, dict] = {}
    for index in range(passes + 1):
        for name, one_pass in sorted({"s3fs": with_s3fs, "boto3": with_boto3}.items(), reverse=index % 2 == 1):
            store.requests()
            started = time.perf_counter()
            one_pass()
            if index:  # the first pass of each makes its client: not kept
                seconds[name].append(time.perf_counter() - started)
                requests[name] = store.requests()
    return {name: {"ms": statistics.median(values) * 1e3, "requests": requests[name]}
            for name, values in seconds.items()}


def report_directory_clients(measured: dict[str, dict]) -> None:
    print("| directory client (s3://) | a reader's pass, ms | requests per pass |")
    print("|---|---|---|")
    for name, seen in measured.items():
        counts = ", ".join(f"{op} {n}" for op, n in seen["requests"].items())
        print(f"| {name} | {seen['ms']:.1f} | {counts} |")
    sys.stdout.flush()


def main(argv) -> None:
    del argv
    from checkpointing._src import marks as marks_lib

    stores: list[Store] = []
    local_root = tempfile.mkdtemp(prefix="store-bench-")
    try:
        for name in _STORES.value:
            stores.append(Store(name, local_root))
        state = checkpoint_state.random_state()
        target = checkpoint_state.abstract_state("same")
        marks_lib.compile_marks(target)
        results: dict[str, list[dict]] = {store.name: [] for store in stores}
        for sample in range(_SAMPLES.value + 1):
            order = stores[sample % len(stores):] + stores[:sample % len(stores)]
            for store in order:
                measured = one_sample(store, sample, state, target)
                if sample:
                    results[store.name].append(measured)
        report(results, checkpoint_state.state_bytes(checkpoint_state.STATE_GIB.value))
        for store in stores:
            if store.name == "s3":
                report_directory_clients(directory_clients(store))
    finally:
        for store in stores:
            store.stop()
        shutil.rmtree(local_root, ignore_errors=True)


def report(results: dict[str, list[dict]], nbytes: int) -> None:
    median = {name: {kind: statistics.median(r[kind] for r in runs) for kind in ("save", "restore")}
              for name, runs in results.items()}
    base = median.get("local")
    print(f"state {nbytes / 2**30:.3f} GiB, {_SAMPLES.value} samples per store (medians)")
    print("| store | save + commit, s | restore, s | save / local | restore / local | save MiB/s | restore MiB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds in median.items():
        ratios = [f"{seconds[k] / base[k]:.2f}" if base else "n/a" for k in ("save", "restore")]
        rates = [f"{nbytes / 2**20 / seconds[k]:.0f}" for k in ("save", "restore")]
        print(f"| {name} | {seconds['save']:.2f} | {seconds['restore']:.2f} | {ratios[0]} | {ratios[1]} | "
              f"{rates[0]} | {rates[1]} |")
    print("| store | requests per save | requests per restore |")
    print("|---|---|---|")
    for name, runs in results.items():
        if runs[-1]["save_requests"]:
            show = lambda counts: ", ".join(f"{op} {n}" for op, n in counts.items())
            print(f"| {name} | {show(runs[-1]['save_requests'])} | {show(runs[-1]['restore_requests'])} |")
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump({"state_bytes": nbytes, "results": results, "medians": median}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    entry.run(main)
