"""The protocol at scale: which storage requests and agreements grow with the host count.

Two parts, against the GCS-protocol server on 127.0.0.1 (tests/gcs_emulator.py, whose request log
counts every request, its kind and its bytes) and, for the first, the S3 server (tests/s3_server.py, the
same log):

  simulated   the service's own multi-host pieces (the lease, the listing of committed steps, the
              verdict listing, the save's and restore's per-process reads: benchmarks/scale_protocol.py)
              run by --hosts simulated processes (threads with their own storage clients), on gs://,
              s3:// and a local disk
  real pods   --pod_processes real JAX processes (launch/local.py, gloo) each running the public
              Checkpointer: open, four steps saving two, close, then open + restore (benchmarks/scale_pod_child.py);
              requests split by whose objects they touch (Orbax's `process_<i>` files) and the
              agreements (collectives, barriers) every process took part in

Counts are the result; wall times only show what a single-threaded local server does under load.

  PYTHONPATH=. .venv/bin/python -m benchmarks.scale_sim [--hosts=4,16,64] [--pod_processes=1,2,4] \
      [--steps_retained=3] [--json_out=FILE]
"""

import collections
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from absl import flags, logging

from benchmarks import common
from runtime import entry

_HOSTS = flags.DEFINE_list("hosts", ["4", "16", "64"], "Simulated processes, one run each.")
_POD_PROCESSES = flags.DEFINE_list("pod_processes", ["1", "2", "4"], "Real pod sizes (empty: none).")
_STEPS_RETAINED = flags.DEFINE_integer("steps_retained", 3, "Committed steps in the simulated workdir.",
                                       lower_bound=1)
_STATE_MB = flags.DEFINE_integer("state_mb", 8, "The real pods' float32 state, MiB.", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results to this file as JSON.")
_POD_TIMEOUT = flags.DEFINE_float("pod_timeout_secs", 300, "Kill a pod after this long.")

BUCKET = "scale"
OWNER = re.compile(r"process_(\d+)")  # Orbax's per-process objects: ocdbt.process_<i>/, array_metadatas/process_<i>


class Emulator:
    """The GCS-protocol server (or, `s3=True`, the S3 server), its environment set in os.environ for the
    in-process clients."""

    def __init__(self, s3: bool = False):
        self._s3 = s3

    def __enter__(self):
        from tests import gcs_emulator, s3_server

        server = s3_server if self._s3 else gcs_emulator
        self.process, self.env = server.start(BUCKET, cwd=common.ROOT, env=common.child_env(1))
        self._saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        self.url = self.env["AWS_ENDPOINT_URL" if self._s3 else "STORAGE_EMULATOR_HOST"]
        return self

    def __exit__(self, *exc):
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def simulate_all(url: str, s3_url: str, hosts: list[int], steps_retained: int, local_root: str) -> dict:
    """{storage: {hosts: [Measured as dict]}} for gs://, s3:// and a local disk."""
    from benchmarks import scale_protocol

    workdirs = {"gs": f"gs://{BUCKET}/sim", "s3": f"s3://{BUCKET}/sim", "local": os.path.join(local_root, "sim")}
    counters = {"gs": lambda threads: scale_protocol.GcsRequests(url),
                "s3": lambda threads: scale_protocol.S3Requests(s3_url), "local": scale_protocol.AuditedCalls}
    results = {}
    for storage, workdir in workdirs.items():
        scale_protocol.make_workdir(workdir, steps_retained, verified=max(steps_retained - 1, 1))
        results[storage] = {}
        for count in hosts:
            rows = scale_protocol.simulate(workdir, count, counters[storage])
            results[storage][count] = [dict(vars(row), per_caller=row.per_caller) for row in rows]
            logging.info("%s, %d simulated processes: %s", storage, count,
                         ", ".join(f"{r.piece} {r.per_caller:g}" for r in rows))
    return results


def run_pod(url: str, env: dict, processes: int, state_mb: int, out: str) -> list[dict]:
    """One real pod of `processes` x 2 CPU devices; every process's JSON (benchmarks/scale_pod_child.py)."""
    command = [sys.executable, "-m", "launch.local", f"--num_processes={processes}", "--devices_per_process=2",
               "--module=benchmarks.scale_pod_child", "--", f"--workdir=gs://{BUCKET}/pod{processes}",
               f"--out={out}", f"--emulator_url={url}", f"--state_mb={state_mb}"]
    proc = subprocess.Popen(command, cwd=common.ROOT, env=dict(common.child_env(2), **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=_POD_TIMEOUT.value)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"a pod of {processes} exited {proc.returncode}:\n{output[-4000:]}")
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(out, "*.json")))]


def summarize_pod(results: list[dict]) -> dict:
    """Per phase: requests and bytes in all, per owner (process i's own objects, or shared), the
    agreements of one process (and whether every process took part in the same ones)."""
    primary = next(r for r in results if r["process"] == 0)
    summary = {"processes": primary["processes"], "saves": primary["saves"], "state_bytes": primary["state_bytes"]}
    for phase, seen in primary["phases"].items():
        owners = collections.Counter()
        for request in seen["requests"]:
            match = OWNER.search(request["name"])
            owners[f"process {match.group(1)}" if match else "shared"] += 1
        summary[phase] = {
            "requests": len(seen["requests"]), "by_owner": dict(owners),
            "bytes_written": sum(r["bytes_in"] for r in seen["requests"]),
            "bytes_read": sum(r["bytes_out"] for r in seen["requests"]),
            "agreements": seen["agreements"], "secs": seen["secs"],
            "same_agreements_everywhere": all(r["phases"][phase]["agreements"] == seen["agreements"] for r in results)}
    return summary


def growth(small: float, large: float, hosts_small: int, hosts_large: int) -> str:
    """How a per-caller count moved between two host counts: constant, or growing like the hosts."""
    if not (large <= small * 1.5 + 1):
        return f"grows ({small:g} -> {large:g} while hosts x{hosts_large / hosts_small:g})"
    return "O(1) per caller"


def report(simulated: dict, pods: list[dict], steps_retained: int) -> str:
    lines = [f"Simulated processes (threads), {steps_retained} committed steps in the workdir: requests per caller "
             "(gs://: GCS requests; s3://: S3 requests; local: audited file-system calls).", ""]
    for storage, by_hosts in simulated.items():
        counts = sorted(by_hosts)
        lines += [f"| {storage} piece | runs on | " + " | ".join(f"{n} hosts" for n in counts) + " | growth |",
                  "|---|---|" + "---|" * len(counts) + "---|"]
        for index, row in enumerate(by_hosts[counts[0]]):
            cells = [by_hosts[n][index] for n in counts]
            values = " | ".join(f"{c['per_caller']:.3g} ({c['requests']} in all, {c['secs'] * 1e3:.0f} ms)"
                                for c in cells)
            lines.append(f"| {row['piece']} | {row['runs_on']} | {values} | "
                         f"{growth(cells[0]['per_caller'], cells[-1]['per_caller'], counts[0], counts[-1])} |")
        lines.append("")
    if pods:
        lines += [f"Real pods ({pods[0]['state_bytes'] / 2**20:.0f} MiB state, 2 CPU devices per process, gs://): "
                  "requests in all (per owner), MB written / read, agreements per process.", "",
                  "| processes | phase | requests | per owner | MB written | MB read | agreements per process |",
                  "|---|---|---|---|---|---|---|"]
        for pod in pods:
            for phase in (k for k in pod if isinstance(pod[k], dict)):
                seen = pod[phase]
                agreements = ", ".join(f"{k} {v}" for k, v in sorted(seen["agreements"].items())) or "none"
                if not seen["same_agreements_everywhere"]:
                    agreements += " (NOT the same on every process)"
                owners = ", ".join(f"{k} {v}" for k, v in sorted(seen["by_owner"].items()))
                lines.append(f"| {pod['processes']} | {phase} | {seen['requests']} | {owners} | "
                             f"{seen['bytes_written'] / 1e6:.2f} | {seen['bytes_read'] / 1e6:.2f} | {agreements} |")
    return "\n".join(lines)


def main(argv):
    del argv
    hosts = sorted(int(n) for n in _HOSTS.value)
    pod_sizes = sorted(int(n) for n in _POD_PROCESSES.value)
    if not hosts or min(hosts) < 2 or (pod_sizes and min(pod_sizes) < 1):
        raise ValueError(f"--hosts={','.join(_HOSTS.value)} (each >= 2), --pod_processes=... (each >= 1)")
    root = tempfile.mkdtemp(prefix="scale_sim_")
    try:
        with Emulator() as emulator, Emulator(s3=True) as s3:
            simulated = simulate_all(emulator.url, s3.url, hosts, _STEPS_RETAINED.value, root)
            pods = [summarize_pod(run_pod(emulator.url, emulator.env, n, _STATE_MB.value,
                                          os.path.join(root, f"pod{n}"))) for n in pod_sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(simulated, pods, _STEPS_RETAINED.value))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump({"command": " ".join(sys.argv), "simulated": simulated, "pods": pods}, f, indent=1)


if __name__ == "__main__":
    entry.run(main)
