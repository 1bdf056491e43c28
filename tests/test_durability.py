"""Durable commits (issue 21, section 3; checkpointing/_src/durable.py): the syscalls of a real save, a
verdict write and a lease write, traced with strace, come in the order fsync the files, rename (or
link), fsync the directory, and only then is the commit reported.

strace is a Debian package that .ci/run installs; outside CI a machine without it skips these tests
(saying why), in CI they fail.
"""

import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest
from orbax.checkpoint._src.path import atomicity

from checkpointing._src import orbax_hooks
from checkpointing._src import workdir as workdir_lib
from tests import helpers

TRACED = "openat,write,fsync,fdatasync,rename,renameat,renameat2,link,linkat,mkdir,mkdirat"
_CALL = re.compile(r"^(\d+)\s+(\w+)\((.*)")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>(.*)")
_FD_PATH = re.compile(r"^\d+<(.*?)>")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def traced(tmp_path, *command: str, env: dict) -> tuple[subprocess.CompletedProcess, list[tuple]]:
    """Runs `command` under strace -f; returns its result and its syscalls in completion order:
    ("fsync", path), ("rename", src, dst), ("link", src, dst) or ("write", path, text)."""
    trace = tmp_path / "strace.out"
    result = subprocess.run([helpers.strace(), "-f", "-qq", "-y", "-s", "300", "-o", str(trace), "-e",
                             f"trace={TRACED}", *command], env=env, cwd=helpers.REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    return result, _events(trace.read_text().splitlines())


def _events(lines: list[str]) -> list[tuple]:
    pending: dict[str, tuple[str, str]] = {}
    events = []
    for line in lines:
        if match := _RESUMED.match(line):
            pid, name, rest = match.groups()
            name, args = pending.pop(pid, (name, ""))
            args += rest
        elif match := _CALL.match(line):
            pid, name, args = match.groups()
            if args.endswith("<unfinished ...>"):
                pending[pid] = (name, args[: -len("<unfinished ...>")])
                continue
        else:
            continue
        if not re.search(r"\)\s+=\s+\d+", args):  # a failed call (-1 E...) did nothing
            continue
        if name in ("fsync", "fdatasync") and (path := _FD_PATH.match(args)):
            events.append(("fsync", path.group(1)))
        elif name in ("rename", "renameat", "renameat2", "link", "linkat"):
            paths = _STRING.findall(args)
            events.append(("link" if name.startswith("link") else "rename", paths[0], paths[1]))
        elif name in ("mkdir", "mkdirat"):
            events.append(("mkdir", _STRING.findall(args)[0]))
        elif name == "write" and (path := _FD_PATH.match(args)):
            text = _STRING.search(args)
            events.append(("write", path.group(1), text.group(1) if text else ""))
    return events


def index_of(events: list[tuple], event: tuple, after: int = -1) -> int:
    for i in range(after + 1, len(events)):
        if events[i] == event:
            return i
    raise AssertionError(f"{event} not traced after event {after}")


def assert_durable_mkdir(events: list[tuple], path: str) -> None:
    """`path` was created, then its parent fsynced (else a crash can lose the directory and all it holds)."""
    index_of(events, ("fsync", os.path.dirname(path)), after=index_of(events, ("mkdir", path)))


def assert_durable_rename(events: list[tuple], kind: str, src: str, dst: str) -> int:
    """The file `src` was fsynced, then renamed (or linked) to `dst`, then dst's directory fsynced;
    returns the index of that directory fsync."""
    moved = index_of(events, (kind, src, dst))
    assert ("fsync", src) in events[:moved], f"{src} was not fsynced before its {kind} to {dst}"
    return index_of(events, ("fsync", os.path.dirname(dst)), after=moved)


@pytest.mark.slow
def test_a_real_save_fsyncs_every_file_then_renames_then_fsyncs_checkpoints_before_it_is_reported(tmp_path, no_job_id):
    workdir = str(tmp_path / "run")
    result, events = traced(tmp_path, sys.executable, "-m", "trainer.train", f"--workdir={workdir}", "--steps=10",
                            *helpers.SMALL_FLAGS, env=helpers.subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    done = [line for line in result.stderr.splitlines() if "done: steps 0..10" in line]
    assert len(done) == 1, result.stderr[-3000:]

    checkpoints = helpers.checkpoint_dir(workdir)
    final, tmp = os.path.join(checkpoints, "10"), os.path.join(checkpoints, "10" + atomicity.TMP_DIR_SUFFIX)
    renamed = index_of(events, ("rename", tmp, final))
    fsynced = {event[1] for event in events[:renamed] if event[0] == "fsync"}
    names = {"_CHECKPOINT_METADATA", "metadata", "_METADATA", "process_0"}  # the four the red team found unsynced
    seen = set()
    for directory, dirs, files in os.walk(final):
        for name in [*dirs, *files, "."]:
            path = os.path.normpath(os.path.join(tmp, os.path.relpath(os.path.join(directory, name), final)))
            assert path in fsynced, f"{path} was not fsynced before the rename to {final}"
            seen.add(name)
    assert names <= seen, f"the save wrote none of {names - seen}"
    parent_synced = index_of(events, ("fsync", checkpoints), after=renamed)
    reported = [i for i, event in enumerate(events) if event[0] == "write" and "done: steps 0..10" in event[2]]
    assert len(reported) == 1 and reported[0] > parent_synced, "reported done before checkpoints/ was fsynced"

    for created in (workdir, lease := workdir_lib.lease_dir(workdir), checkpoints):
        assert_durable_mkdir(events, created)

    # The lease: created by a link, released by a rename, each fsynced through the lease directory.
    moves = [event for event in events if event[0] in ("link", "rename") and event[2].startswith(lease + os.sep)]
    assert [kind for kind, *_ in moves] == ["link", "rename"], moves
    for kind, src, dst in moves:
        assert_durable_rename(events, kind, src, dst)


@pytest.mark.slow
def test_a_verdict_write_fsyncs_the_file_renames_it_then_fsyncs_the_verdicts_directory(tmp_path):
    workdir = str(tmp_path / "run")
    script = textwrap.dedent(f"""
        from checkpointing._src import verdicts
        verdicts.write({workdir!r}, verdicts.make(step=10, level="reproduced", status="pass", detail="test",
                       checkpoint_mesh={{"data": 8}}, verifier_mesh={{"data": 8}}, durations_secs={{}}))
        verdicts.write({workdir!r}, verdicts.make(step=10, level="reproduced", status="fail", detail="again",
                       checkpoint_mesh={{"data": 8}}, verifier_mesh={{"data": 8}}, durations_secs={{}}), replace=True)
    """)
    result, events = traced(tmp_path, sys.executable, "-c", script, env=helpers.subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    path = str(workdir_lib.verdict_file(workdir, 10))
    renames = [event for event in events if event[0] == "rename" and event[2] == path]
    assert len(renames) == 2, events[-20:]
    for _, src, dst in renames:
        assert os.path.dirname(src) == os.path.dirname(dst)
        assert_durable_rename(events, "rename", src, dst)
    assert os.listdir(os.path.dirname(path)) == ["10.json"], "a tmp file was left behind"
    for created in (workdir, os.path.dirname(path)):
        assert_durable_mkdir(events, created)


def test_the_durable_commit_is_orbax_finalize_with_the_fsyncs_added():
    """orbax_hooks.DurableRename repeats Orbax's AtomicRenameTemporaryPath.finalize: an Orbax upgrade
    that changes it must be read again (and DurableRename updated) before this passes."""
    source = inspect.getsource(atomicity.AtomicRenameTemporaryPath.finalize)
    for piece in ("commit_timestamp_nsecs=time.time_ns()", "COMMIT_SUCCESS_FILE", "step_metadata_file_path",
                  "async_path.rename(self._tmp_path, self._final_path)"):
        assert piece in source, f"Orbax's finalize changed ({piece!r} is gone): read it and update DurableRename"
    body = re.sub(r'"""[\s\S]*?"""', "", source)
    assert body.count("await ") == 6, "Orbax's finalize gained or lost a step: read it and update DurableRename"
    assert issubclass(orbax_hooks.DurableRename, atomicity.AtomicRenameTemporaryPath)
