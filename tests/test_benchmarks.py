"""Every benchmark in benchmarks/ runs at its smallest size and prints its result rows.

A benchmark never fails on a number (docs/performance.md), but a code path it times can move: a
probed call no longer made, a trainer flag or log line it reads changed. Then it breaks at the next
measurement, not in CI. Here each one runs with its smallest flags (a tiny state, one round, a few
steps): it must exit 0 and print every result row named below, each with finite numbers.

To add a benchmark: its module -> Smallest(flags, rows) in BENCHMARKS; a module it runs or imports
goes in HELPERS. A module of benchmarks/ in neither fails the fast test here.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys

import psutil
import pytest

from tests import helpers

BENCHMARKS_DIR = os.path.join(helpers.REPO_ROOT, "benchmarks")
TIMEOUT_SECS = 900  # a hung benchmark is ended (by PID) after this; no result depends on it


@dataclasses.dataclass(frozen=True)
class Smallest:
    flags: tuple[str, ...]  # the smallest run that still takes every code path the benchmark times
    rows: tuple[str, ...]  # the result rows it must print, by first cell (a table row, or a `label  value` line)
    columns: tuple[int, ...] = (1,)  # the cells of each of those rows that must hold a finite number


_VERIFIER_ROWS = tuple(
    row.format(b=budget) for budget in ("0", "1") for row in (
        "commit -> first verdict (verify_budget={b}) / plain restore",
        "commit -> complete verdict (verify_budget={b}) / plain restore",
        "verifier's own restore (verify_budget={b}) / plain restore",
        "trainer steps proved per second (verify_budget={b}) / trainer steps/s",
        "verifier's replayed steps per second (verify_budget={b}) / trainer steps/s",
        "training steps/s with verifier (verify_budget={b}) / alone"))

BENCHMARKS = {
    "checkpoint_bench": Smallest(
        ("--state_gib=0.002", "--array_mib=1", "--repeats=1", "--samples=1", "--verbosity=-1"),
        rows=("blocking_over_plain_orbax_blocking", "unmarked_blocking_over_plain_orbax_blocking",
              "marked_step_over_plain_step", "async_blocking_over_sync_save", "service_save_over_plain_orbax",
              "unmarked_save_over_plain_orbax", "blocking_over_plain_orbax_two_items_blocking",
              "service_save_over_plain_orbax_two_items", "fingerprint_over_state_read", "restore_data8_over_same",
              "restore_model8_over_same", "restore_fingerprint_check_over_restore", "peak_rss_save_over_state",
              "peak_rss_plain_orbax_save_over_state", "peak_rss_restore_over_state"),
        columns=(2,)),
    "compile_bench": Smallest(("--models=mlp", "--samples=1"), rows=("mlp",), columns=(9, 10, 11, 12, 13, 14, 15)),
    "data_identity_bench": Smallest(
        ("--size_mib=2", "--shard_mib=1", "--repeats=1", "--cheap_samples=1"),
        rows=("ratio: stat / plain", "ratio: full / plain", "ratio: full, cold / plain", "full: GiB/s hashed",
              "full, cold: GiB/s hashed")),
    "device_bench": Smallest(
        ("--state_gibs=0.004", "--array_mib=1", "--samples=1", "--realistic=8,4", "--write_bound=4,2",
         "--restart_steps=2", "--verifier_run=8,4", "--verifier_grace_secs=120",
         "--model_flags=--model=mlp,--hidden_dim=16,--num_layers=1,--batch_size=8",
         "--verifier_model_flags=--model=mlp,--hidden_dim=16,--num_layers=1,--batch_size=8"),
        rows=("0.004", "ideal", "plain_orbax", "service", "open", "compile", "restore", "first_step", "verifier"),
        columns=(2, 3)),
    "goodput_bench": Smallest(
        ("--steps=10", "--save_every_steps=5", "--preemptions=1", "--rounds=1", "--hidden_dim=16", "--batch_size=8",
         "--settle_secs=0"),
        rows=("ideal", "service", "plain_orbax", "service_auto", "service_no_cache"), columns=(1, 2)),
    "input_bench": Smallest(
        ("--steps=1", "--rounds=1", "--max_bytes=100000", "--batch_size=8", "--seq_len=16", "--hidden_dim=8"),
        rows=("batch alone: records, ms (median)", "batch alone: synthetic, ms (median)",
              "train step: records, ms (median)", "train step: synthetic, ms (median)",
              "records: input wait per step, ms (median)", "records: batch call per step, ms (median)",
              "ratio: train step records / synthetic (target <= 1.05)")),
    "proof_cost": Smallest(("--intervals=2",), rows=("2",), columns=(2, 3, 4)),
    "save_cost_trace": Smallest(
        ("--steps=8", "--every=4", "--offsets=2",
         "--model_flags=--model=mlp,--hidden_dim=16,--num_layers=1,--batch_size=8"),
        rows=("0", "1", "a step far from saves"), columns=(1, 2, 3)),
    "scale_sim": Smallest(
        ("--hosts=2", "--pod_processes=2", "--steps_retained=1", "--state_mb=1"),
        rows=("lease_acquire", "lease_renewal", "lease_check", "lease_holder", "save_check", "listing",
              "manifest_read", "verdict_listing", "2"),  # "2": the 2-process pod's rows (requests in column 2)
        columns=(2,)),
    "store_bench": Smallest(("--state_gib=0.004", "--array_mib=1", "--samples=1"), rows=("local", "gs", "s3"),
                            columns=(1, 2, 3, 4)),
    "verdict_matrix": Smallest(
        ("--groups=genuine,broken,silent", "--design=families", "--families=mlp", "--seeds=1",
         "--cases=zeroed_moments_saved",
         "--broken_meshes=data=2", "--silent_sizes=1e-2", "--silent_meshes=data=2"),
        rows=("mlp", "genuine runs", "largest genuine ratio", "broken runs detected", "smallest broken ratio",
              "silent corruption (mlp, kernel): smallest size caught on data=2")),
    "verifier_bench": Smallest(
        ("--min_state_mib=0", "--hidden_dim=16", "--num_layers=2", "--steps=4", "--save_every_steps=2", "--rounds=1",
         "--restore_repeats=1"),
        rows=_VERIFIER_ROWS),
}

# Modules of benchmarks/ that are not benchmarks -> the benchmarks that run or import them.
HELPERS = {
    "common": ("checkpoint_bench", "compile_bench", "data_identity_bench", "goodput_bench", "input_bench", "scale_sim",
               "store_bench"),
    "checkpoint_child": ("checkpoint_bench",),
    "checkpoint_state": ("checkpoint_bench", "store_bench"),
    "device_child": ("device_bench",),
    "device_report": ("device_bench",),
    "goodput_events": ("goodput_bench",),
    "goodput_report": ("goodput_bench",),
    "plain_orbax_trainer": ("goodput_bench", "device_bench"),
    "scale_protocol": ("scale_sim",),
    "scale_pod_child": ("scale_sim",),
    "verdict_broken": ("verdict_matrix",),
    "verdict_design": ("verdict_matrix",),
    "verdict_runs": ("verdict_matrix",),
    "verifier_pace": ("verifier_bench", "device_bench"),
    "verifier_scan": ("verifier_bench", "device_bench"),
}

_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))", re.IGNORECASE)


def result_rows(stdout: str) -> dict[str, list[str]]:
    """{first cell: cells} of the markdown table rows and the `  label   value` lines of `stdout` (the first
    row of each label)."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("|"):
            cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            if not set("".join(cells)) - set("-: "):
                continue  # a header's separator
        elif match := re.fullmatch(r"\s+(\S.*?)\s{2,}(\S+)", line):
            cells = list(match.groups())
        else:
            continue
        rows.setdefault(cells[0], cells)
    return rows


def leading_number(cell: str) -> float | None:
    match = _NUMBER.match(cell)
    return float(match[1]) if match else None


def run_benchmark(module: str, flags: tuple[str, ...], tmp_dir: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m benchmarks.<module>`, its temporary files under `tmp_dir`.
    On a timeout it and every process it started are killed by PID, and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", *flags], cwd=helpers.REPO_ROOT,
                            env=helpers.subprocess_env(TMPDIR=tmp_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_SECS)
    except subprocess.TimeoutExpired:
        _kill_with_descendants(proc)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"benchmarks.{module} still running after {TIMEOUT_SECS}s; stderr tail:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            _kill_with_descendants(proc)
            proc.wait(timeout=60)
    return proc.returncode, out, err


def _kill_with_descendants(proc: subprocess.Popen) -> None:
    """The benchmark and what it started (in process groups of their own, so not reached by its group)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    proc.kill()
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=30)


def test_every_module_of_benchmarks_is_a_benchmark_with_its_smallest_flags_or_a_named_helper():
    modules = {name[:-3] for name in os.listdir(BENCHMARKS_DIR) if name.endswith(".py") and name != "__init__.py"}
    unlisted = sorted(modules - set(BENCHMARKS) - set(HELPERS))
    assert not unlisted, (f"benchmarks/{unlisted[0]}.py is in neither table of tests/test_benchmarks.py: a benchmark "
                          "goes in BENCHMARKS with its smallest flags and result rows, a module one of them runs "
                          "or imports in HELPERS")
    assert not set(BENCHMARKS) & set(HELPERS)
    assert not (set(BENCHMARKS) | set(HELPERS)) - modules, "a table names a module benchmarks/ no longer has"
    for helper, users in HELPERS.items():
        for user in users:
            assert user in BENCHMARKS, f"{helper}: {user} is not a benchmark in BENCHMARKS"
            with open(os.path.join(BENCHMARKS_DIR, f"{user}.py")) as f:
                assert re.search(rf"benchmarks(\.| import .*\b){helper}\b", f.read()), f"{user} does not use {helper}"


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(BENCHMARKS))
def test_the_benchmark_runs_at_its_smallest_size_and_prints_its_result_rows(module, tmp_path):
    smallest = BENCHMARKS[module]
    code, out, err = run_benchmark(module, smallest.flags, str(tmp_path))
    assert code == 0, f"benchmarks.{module} exited {code}; stderr tail:\n{err[-3000:]}"
    rows = result_rows(out)
    missing = [row for row in smallest.rows if row not in rows]
    assert not missing, f"benchmarks.{module} printed no row {missing}; its stdout:\n{out[-3000:]}"
    for row in smallest.rows:
        cells = rows[row]
        for column in smallest.columns:
            value = leading_number(cells[column]) if column < len(cells) else None
            assert value is not None and math.isfinite(value), (
                f"benchmarks.{module}, row {row!r}: cell {column} is {cells[column:column + 1]}, not a finite "
                f"number; the row: {cells}")
