"""Verdicts in-process on hand-built JSON: the atomic write, the schema on read (a damaged file counts as
no verdict), which verdicts may anchor a proof or a resume (`is_proved`), and which may replace another
(a complete verdict is final for its save unless --reverify)."""

import json
import logging
import os

import pytest

from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from checkpointing.errors import CheckpointError, ManifestError


def verdict(step: int, level: str = "reproduced", status: str = "pass", **fields) -> dict:
    """A verdict as the verifier writes it: a proving one binds the content it proved (content_sha256)."""
    made = verdicts.make(step=step, level=level, status=status, detail=f"step {step}: test",
                         checkpoint_mesh={"data": 4, "model": 2}, verifier_mesh={"data": 2},
                         durations_secs={"restore": 0.123456}, **fields)
    if status == "pass" and level in verdicts.PROVED_LEVELS:
        made["content_sha256"] = {".params['w']": "0" * 64}
    return made


def test_a_proving_verdict_without_the_content_it_proved_proves_nothing():
    bound = verdict(10)
    assert verdicts.is_proved(bound)
    assert not verdicts.is_proved({k: v for k, v in bound.items() if k != "content_sha256"})
    assert not verdicts.is_proved({**bound, "content_sha256": {}})


def test_write_then_read_round_trips_and_leaves_only_the_verdict(tmp_path):
    workdir = str(tmp_path)
    written = verdict(10, replayed_from=0, replayed_steps=10, compared_losses=10, max_relative_difference=0.0)
    verdicts.write(workdir, written)
    assert verdicts.read(workdir, 10) == written
    assert written["durations_secs"] == {"restore": 0.1235} and written["complete"] is True
    assert os.listdir(workdir_lib.verdicts_dir(workdir)) == ["10.json"], "no tmp file left behind"
    assert verdicts.read(workdir, 20) is None


def test_a_rewrite_replaces_the_whole_file(tmp_path):
    workdir = str(tmp_path)
    verdicts.write(workdir, verdict(10, level="intact", complete=False))
    verdicts.write(workdir, verdict(10))
    assert (verdicts.read(workdir, 10)["level"], verdicts.read(workdir, 10)["complete"]) == ("reproduced", True)
    assert os.listdir(workdir_lib.verdicts_dir(workdir)) == ["10.json"]


def test_a_failed_write_is_one_error_naming_the_step_and_leaves_no_tmp_file(tmp_path):
    workdir = str(tmp_path)
    os.makedirs(workdir_lib.verdict_file(workdir, 10))  # a directory where the file goes: the rename fails
    with pytest.raises(CheckpointError, match=r"^verdict of step 10: cannot write .*/verdicts/10\.json: "):
        verdicts.write(workdir, verdict(10))
    assert os.listdir(workdir_lib.verdicts_dir(workdir)) == ["10.json"]


@pytest.mark.parametrize("text, damage", [
    ("{not json", "not valid JSON"),
    ('{"step": 10, "level": "repro', "not valid JSON"),  # half a file, as a power loss leaves it
    ("[]", "not a JSON object"),
    (json.dumps({"step": 10}), "field 'level' must be str"),
    (b"\xff\xfe", "not UTF-8 text"),
])
def test_a_damaged_verdict_counts_as_none_with_one_warning_and_inspect_calls_it_damaged(tmp_path, caplog, text,
                                                                                          damage):
    workdir = str(tmp_path)
    path = workdir_lib.verdict_file(workdir, 10)
    path.parent.mkdir(parents=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    verdicts.write(workdir, verdict(20))
    assert verdicts.load(workdir, 10)[0] is None and verdicts.load(workdir, 10)[1].startswith(damage)
    with caplog.at_level(logging.WARNING):
        assert verdicts.read(workdir, 10) is None
        assert verdicts.newest_proved_step(workdir, [10, 20]) == 20
        assert verdicts.proved_steps(workdir, [10]) == []
        assert sorted(verdicts.read_all(workdir)) == [20]
    warned = [r.getMessage() for r in caplog.records if "verdict of step 10 is damaged" in r.getMessage()]
    assert len(warned) == 1 and damage in warned[0], warned
    assert verdicts.describe(workdir, 10) == "damaged (unproved)"
    verdicts.write(workdir, verdict(10))  # the verifier rewrites it
    assert verdicts.read(workdir, 10)["detail"] == "step 10: test"
    assert verdicts.describe(workdir, 10) == "reproduced pass"


@pytest.mark.parametrize("edit, message", [
    (lambda v: v.update(level="proved"), "bad level/status 'proved'/'pass'"),
    (lambda v: v.update(status="ok"), "bad level/status 'reproduced'/'ok'"),
    (lambda v: v.update(step=True), "field 'step' must be int"),
    (lambda v: v.update(complete=1), "field 'complete' must be bool"),
    (lambda v: v.pop("verified_at"), "field 'verified_at' must be str"),
])
def test_the_schema_names_what_is_wrong(edit, message):
    broken = verdict(10)
    edit(broken)
    with pytest.raises(ManifestError, match=f"^verdict: {message}"):
        verdicts.validate(broken)


@pytest.mark.parametrize("level, status, complete, reproduced", [
    ("reproduced", "pass", True, True),
    ("reproduced", "fail", True, False),
    ("replayed", "pass", True, False),
    ("intact", "pass", False, False),
    ("reproduced", "gone", True, False),
    ("resumes", "pass", True, True),
    ("resumes", "fail", True, False),
    ("reproduced", "inconclusive", True, False),
    ("reproduced", "error", False, False),
    ("intact", "error", False, False),
])
def test_only_a_passing_proof_verdict_anchors_a_proof_or_a_resume(level, status, complete, reproduced):
    assert verdicts.is_proved(verdict(10, level=level, status=status, complete=complete)) is reproduced


def test_proved_steps_reads_only_the_steps_asked_for(tmp_path):
    workdir = str(tmp_path)
    for step, level, status in [(10, "reproduced", "pass"), (20, "reproduced", "fail"), (30, "replayed", "pass"),
                                (40, "reproduced", "pass"), (50, "reproduced", "pass")]:
        verdicts.write(workdir, verdict(step, level=level, status=status))
    assert verdicts.proved_steps(workdir, [40, 10, 20, 30, 60]) == [10, 40]
    assert verdicts.newest_proved_step(workdir, [10, 20, 30, 40]) == 40
    assert verdicts.newest_proved_step(workdir, [20, 30]) is None
    for among in ([10, 20, 30, 40, 50, 60], [10, 20, 30], [30, 20], [60], []):  # the newest of proved_steps
        assert verdicts.newest_proved_step(workdir, among) == (verdicts.proved_steps(workdir, among) or [None])[-1]
    assert sorted(verdicts.read_steps(workdir, [30, 60])) == [30]
    assert sorted(verdicts.read_all(workdir)) == [10, 20, 30, 40, 50]
    assert verdicts.read_all(str(tmp_path / "nothing")) == {}


def test_summary_is_what_inspect_shows():
    assert verdicts.summary(None) == "-"
    assert verdicts.summary(verdict(10)) == "reproduced pass"
    assert verdicts.summary(verdict(10, level="intact", complete=False)) == "intact pass (replaying)"
    # An error is written incomplete (the next verifier run retries it), but nothing is replaying it.
    assert verdicts.summary(verdict(10, level="intact", status="error", complete=False)) == "intact error"
    assert verdicts.summary(verdict(10, status="inconclusive")) == "reproduced inconclusive"


def test_the_plot_colours_every_status_and_inconclusive_and_error_apart_from_pass_and_fail():
    from checkpointing._src import plot

    colours = {status: plot.colour_of(verdict(10, status=status)) for status in verdicts.STATUSES}
    assert len({colours["pass"], colours["fail"], colours["inconclusive"], colours["error"]}) == 4, colours


SAVE, OTHER_SAVE = "a" * 64, "b" * 64  # two manifest digests


@pytest.mark.parametrize("new, replace, written", [
    (dict(status="fail"), False, False),  # a pass is never overwritten by a fail of the same save
    (dict(level="intact", status="fail", manifest_digest=None), False, False),  # one that could not read it
    (dict(status="gone"), False, False),
    (dict(level="intact", complete=False), False, False),  # an intact part never stands in for a reached verdict
    (dict(status="fail", manifest_digest=OTHER_SAVE), False, True),  # another save of the step
    (dict(status="fail"), True, True),  # --reverify
    (dict(level="intact", status="error", complete=False), True, False),  # a fault never replaces a verdict
    (dict(level="intact", complete=False), True, False),  # redone: the old verdict stays until the new one
])
def test_a_complete_verdict_is_final_for_its_save_unless_reverified(tmp_path, new, replace, written):
    workdir = str(tmp_path)
    verdicts.write(workdir, verdict(10, manifest_digest=SAVE))
    before = workdir_lib.verdict_file(workdir, 10).read_bytes()
    replacement = verdict(10, **{"manifest_digest": SAVE, **new})
    assert verdicts.write(workdir, replacement, replace=replace) is written
    assert verdicts.read(workdir, 10) == (replacement if written else json.loads(before))
    assert os.listdir(workdir_lib.verdicts_dir(workdir)) == ["10.json"]


@pytest.mark.parametrize("first", [dict(level="intact", complete=False),
                                   dict(level="intact", status="error", complete=False)])
def test_an_incomplete_verdict_is_replaced_by_the_next(tmp_path, first):
    workdir = str(tmp_path)
    verdicts.write(workdir, verdict(10, manifest_digest=SAVE, **first))
    assert verdicts.write(workdir, verdict(10, level="intact", status="fail", manifest_digest=SAVE)) is True
    assert verdicts.read(workdir, 10)["status"] == "fail"


def test_the_newest_proved_step_reads_from_the_newest_down_and_stops_at_the_first_proved(tmp_path, monkeypatch):
    workdir = str(tmp_path)
    for step in range(10, 110, 10):
        verdicts.write(workdir, verdict(step, level="reproduced", status="fail" if step == 100 else "pass"))
    read = []
    original = verdicts.read
    monkeypatch.setattr(verdicts, "read", lambda w, step: read.append(step) or original(w, step))
    assert verdicts.newest_proved_step(workdir, list(range(10, 110, 10))) == 90
    assert read == [100, 90]


def test_past_the_newest_two_steps_one_listing_says_which_older_steps_have_a_verdict_to_read(tmp_path, monkeypatch):
    """A verifier behind or not running: retention (at every save) reads two verdicts and lists once, not one
    read per kept step; the answer is still proved_steps()[-1]."""
    workdir = str(tmp_path)
    steps = list(range(10, 1010, 10))  # 100 kept steps, e.g. milestones
    read = []
    original = verdicts.read
    monkeypatch.setattr(verdicts, "read", lambda w, step: read.append(step) or original(w, step))
    assert verdicts.newest_proved_step(workdir, steps) is None  # no verdicts directory yet
    assert read == [1000, 990]
    verdicts.write(workdir, verdict(300, level="resumes", status="pass"))
    verdicts.write(workdir, verdict(500, level="reproduced", status="fail"))
    read.clear()
    assert verdicts.newest_proved_step(workdir, steps) == 300
    assert read == [1000, 990, 500, 300]
    monkeypatch.setattr(verdicts, "read", original)
    for among in (steps, steps[:29], steps[30:], [300, 990, 1000], [500]):
        assert verdicts.newest_proved_step(workdir, among) == (verdicts.proved_steps(workdir, among) or [None])[-1]
