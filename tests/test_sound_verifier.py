"""A verifier sound for accidents (docs/verifier.md, "The bound"): a bound that holds for the recording layout, no
leaf left unjudged, exact on the recording layout whatever else the workdir holds, the record that disagrees
with its steps is the suspect, blame on the first wrong step, a proof bound to its content, and exit codes a
job can trust. Real trainer runs (8 fake CPU devices), real verifiers."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import verdict_runs
from checkpointing._src import content
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
from runtime import exit_codes
from tests import helpers, tamper
from tests.tamper import RUN
from trainer import loop
from trainer.models.measured import ORDINARY_KEYS
from verifier.evidence import MARGIN

pytestmark = pytest.mark.slow

BN = {**RUN, "steps": 15, "save_every_steps": 5, "model": "examples.bn_classifier:spec", "seed": 1}
BN_MEAN = ".model_state['batch_stats']['BatchNorm_0']['mean']"
BN_BIAS = ".params['Dense_0']['bias']"  # the bias right before a BatchNorm: no gradient, rounding noise only


def statuses(verification) -> dict[int, tuple[str, str]]:
    return {step: (s.level, s.status) for step, s in verification.steps.items()}


def test_the_wide_mlp_recorded_on_data4_model2_is_proved_on_two_devices(trained_copy):
    """The case that failed at 542x the old noise: seed 4 of the wide mlp, its first save of 20 steps, recorded on
    data=4,model=2 and verified by the README's command on 2 devices. Proved, and the verdict names the bound."""
    config = trained_copy(**{**tamper.WIDE, "steps": 20, "save_every_steps": 20})
    run = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=2", "--once",
                             device_count=2, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = verdicts.read_all(config.workdir)[20]
    assert (found["level"], found["status"]) == ("reproduced", "pass"), found["detail"]
    assert "perturbed by up to" in found["detail"] and found["evidence"]["perturbation"] > 0
    assert found["evidence"]["ratio"] <= MARGIN
    assert "verified: 1 of 1 committed steps proved, 0 failed, 0 unproved" in run.stdout


def test_a_leaf_whose_spread_is_wide_is_still_judged(trained_copy):
    """A Dense-with-bias -> BatchNorm classifier saving every 5 steps: its BatchNorm running mean moved by +3.0 at
    step 10, the bias before that BatchNorm (no gradient: rounding noise only) moved by +3.0 at 15, fingerprints
    recomputed. The losses see neither; the leaves, judged against their own wide spread, do: 10 and 15 fail,
    each naming its leaf, and 5, untouched, is proved across layouts by a perturbed bound."""
    config = trained_copy(**BN)
    tamper.rewrite_step(config, 10, tamper.shift_leaf(BN_MEAN, 3.0), keep_saved_fingerprints=False)
    tamper.rewrite_step(config, 15, tamper.shift_leaf(BN_BIAS, 3.0), keep_saved_fingerprints=False)
    found = verdict_runs.verify(config.workdir, "data=2")
    assert statuses(found) == {5: ("reproduced", "pass"), 10: ("reproduced", "fail"), 15: ("reproduced", "fail")}, [
        s.detail for s in found.steps.values()]
    written = verdicts.read_all(config.workdir)
    assert written[10]["mismatch"]["where"] == BN_MEAN and written[15]["mismatch"]["where"] == BN_BIAS
    assert written[15]["replayed_from"] == 5, "proved from the step before the wrong one"
    assert written[5]["evidence"]["perturbation"] > 0 and written[5]["evidence"]["ratio"] <= MARGIN


def test_a_copied_directory_never_turns_the_recording_layout_into_a_tolerance(trained_copy):
    """An operator copies step 20 to checkpoints/25; step 30's params x (1 + 1e-5 noise), fingerprints
    recomputed. On the recording layout step 30 still fails bit for bit; 10 and 20 pass."""
    config = trained_copy(**RUN)
    shutil.copytree(str(workdir_lib.step_dir(config.workdir, 20)), str(workdir_lib.step_dir(config.workdir, 25)))
    tamper.rewrite_step(config, 30, tamper.noisy_params(1e-5), keep_saved_fingerprints=False)
    found = verdict_runs.verify(config.workdir, "data=4,model=2")
    assert [found.steps[s].status for s in (10, 20, 30)] == ["pass", "pass", "fail"], [
        s.detail for s in found.steps.values()]
    assert found.steps[30].ratio is None, "bit for bit: no tolerance, no ratio"


def test_a_proving_verdict_without_its_content_proves_nothing(trained_copy):
    config = trained_copy(**RUN_20)
    verdict_runs.verify(config.workdir, "data=4,model=2")
    path = workdir_lib.verdict_file(config.workdir, 20)
    verdict = json.loads(path.read_text())
    assert verdicts.is_proved(verdict)
    del verdict["content_sha256"]
    path.write_text(json.dumps(verdict))
    assert not verdicts.is_proved(verdicts.read(config.workdir, 20))
    assert verdicts.proved_steps(config.workdir, [10, 20]) == [10]


RUN_20 = {**RUN, "steps": 20}


def test_a_run_json_copied_from_another_run_is_the_suspect_not_the_steps(trained_copy, trained_runs, caplog):
    """Another seed's run.json over a run's own: the verifier proves every step from what its manifests agree
    on (a warning names the record), and the trainer resumes."""
    config = trained_copy(**RUN_20)
    other = trained_runs(**{**RUN_20, "seed": 7})
    shutil.copy(os.path.join(other, "run.json"), os.path.join(config.workdir, "run.json"))
    found = verdict_runs.verify(config.workdir, "data=4,model=2")
    assert statuses(found) == {10: ("reproduced", "pass"), 20: ("reproduced", "pass")}, [
        s.detail for s in found.steps.values()]
    assert any("records another run than every committed step" in r.getMessage() for r in caplog.records)
    resumed = loop.train(helpers.small_config(config.workdir, **{**RUN_20, "steps": 30}))
    assert sorted(resumed.losses) == list(range(20, 30))


def test_blame_lands_on_the_anchor_that_only_the_cheap_proof_had_proved(trained_copy):
    """Step 20 wrong (its params x (1 + 1e-5 noise), fingerprints recomputed) but given a cheap proof's passing
    verdict bound to its content, as a cheap proof that could not see it would: with --verify_budget=0 the full
    proof of 30 starts from 20 and fails; it is proved again from the init and passes, and 20 gets the fail."""
    config = trained_copy(**RUN)
    tamper.rewrite_step(config, 20, tamper.perturb_params, keep_saved_fingerprints=False)
    state = _restored(config, 20)
    manifest = workdir_lib.read_manifest(config.workdir, 20)
    cheap = verdicts.make(step=20, level="resumes", status="pass", complete=True, detail="cheap proof", mismatch=None,
                          checkpoint_mesh=manifest["mesh"], verifier_mesh=manifest["mesh"], durations_secs={},
                          max_relative_difference=0.0, replayed_from=20, replayed_steps=4, compared_losses=4,
                          manifest_digest=manifest["digest"], evidence=None)
    cheap["content_sha256"] = content.leaf_digests(state)
    verdicts.write(config.workdir, cheap)
    from verifier.verifier import Verifier, VerifierOptions

    Verifier(VerifierOptions(workdir=config.workdir, mesh=helpers.MESHES["data=4,model=2"],
                             verify_budget=0.0)).verify_pending()
    found = verdicts.read_all(config.workdir)
    assert (found[20]["level"], found[20]["status"]) == ("reproduced", "fail"), found[20]["detail"]
    assert (found[30]["status"], found[30]["replayed_from"]) == ("pass", 0), found[30]["detail"]
    assert "only the cheap proof had proved" in found[30]["detail"]


def _restored(config, step):
    from checkpointing._src.service import CheckpointService
    from trainer.program import build_mesh, build_program

    program = build_program(config, build_mesh(config))
    return CheckpointService(config.workdir, read_only=True).restore(step, program.abstract_state).state


def test_exit_codes_say_proved_only_when_every_step_is_proved(trained_copy):
    """One device has no other layout to bound a proof with: every step inconclusive, exit UNPROVED (3) with one
    line counting them, not 0; the recording layout proves all: 0 (a failed step's 1: tests/test_verifier.py)."""
    config = trained_copy(**RUN_20)
    alone = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=1", "--once",
                               device_count=1, timeout=600)
    assert alone.returncode == exit_codes.UNPROVED, alone.stderr[-2000:]
    last = alone.stderr.strip().splitlines()[-1]
    assert last.startswith("unproved: not proved: 10: reproduced inconclusive, 20: reproduced inconclusive"), last
    assert last.endswith("(0 of 2 committed steps proved, 0 failed, 2 unproved)"), last
    proved = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=4,model=2", "--once",
                                "--reverify=all", device_count=8, timeout=600)
    assert proved.returncode == 0, proved.stderr[-2000:]
    assert "verified: 2 of 2 committed steps proved, 0 failed, 0 unproved" in proved.stdout


@pytest.mark.parametrize("flag, says", [
    ("--replay_steps=0", "--replay_steps=0 replays nothing"),
    ("--verify_budget=nan", "--verify_budget=nan"),
    ("--reverify=10,,20", "--reverify=10,,20"),
])
def test_flag_values_that_make_a_proof_vacuous_are_bad_input(trained_copy, flag, says):
    config = trained_copy(**RUN_20)
    run = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=2", "--once", flag,
                             device_count=2, timeout=120)
    assert run.returncode == exit_codes.BAD_INPUT and run.stderr.strip().splitlines()[-1].startswith(
        f"error: {says}"), run.stderr[-2000:]
    assert not os.path.exists(workdir_lib.verdicts_dir(config.workdir)), "a refused run writes nothing"


def test_a_tolerance_file_whose_bounds_cannot_fail_is_bad_input(trained_copy, tmp_path):
    config = trained_copy(**RUN_20)
    loose = tmp_path / "loose.json"
    bounds = {key: 1e30 for key in ORDINARY_KEYS}
    loose.write_text(json.dumps({"model": "mlp", "provable_across_layouts": True, **bounds, "noise_ratio": 0.05,
                                 "noise_factor": 2.0}))
    run = helpers.run_module("verifier.verify", f"--workdir={config.workdir}", "--mesh=data=2", "--once",
                             f"--tolerances={loose}", device_count=2, timeout=120)
    assert run.returncode == exit_codes.BAD_INPUT, run.stderr[-2000:]
    assert "cannot fail" in run.stderr.strip().splitlines()[-1]


def test_perturbed_members_are_the_same_numbers_on_every_mesh():
    """A member's draws are a function of (seed, step, leaf), never of the layout it runs on."""
    from runtime import mesh as mesh_lib
    from verifier import perturb

    values = {"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "n": np.arange(3, dtype=np.int32)}
    out = []
    for axes in ({"data": 8}, {"data": 2, "model": 4}):
        mesh = mesh_lib.build(axes)
        shardings = {"w": NamedSharding(mesh, P("data", None)), "n": NamedSharding(mesh, P())}
        state = jax.device_put(values, shardings)
        member = perturb.Perturbation(shardings, {"['w']": 1e-3}, seed=1)
        out.append(jax.device_get(member(state, 7)))
    assert np.array_equal(out[0]["w"], out[1]["w"]) and not np.array_equal(out[0]["w"], values["w"])
    assert np.array_equal(out[0]["n"], values["n"]), "integer leaves are exact: never perturbed"
