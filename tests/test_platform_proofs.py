"""The platform in the proof: a run recorded on another platform is proved within the bound across layouts
where it can be, and where it differs beyond it the verdict is inconclusive, never fail, at any matmul precision
(a TPU v5e's genuine transformer at --matmul_precision=highest replayed on CPU 191-3942x that noise,
docs/verifier.md); only an integer leaf, exact everywhere, still fails there. No accelerator here: the platform
a manifest records is rewritten (with its digest) to say TPU, the numbers stay the CPU's."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import workdir as workdir_lib
from checkpointing._src.workdir import committed_steps
from tests import helpers, tamper
from verifier import evidence, layouts

RUN = {**helpers.SHARED_RUN, "steps": 20}
TPU = {"backend": "tpu", "device_kind": "TPU v5 lite", "jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.30",
       "matmul_precision": "default", "x64": False}


def _recorded_on(workdir: str, platform: dict) -> None:
    """Every manifest of `workdir` says it was computed on `platform` (its digest recomputed: consistent)."""
    for step in committed_steps(workdir):
        path = workdir_lib.manifest_file(workdir, step)
        manifest = json.loads(path.read_text())
        manifest["platform"] = platform
        manifest["digest"] = manifest_lib.digest(manifest)
        path.write_text(json.dumps(manifest))


def _evidence(*ratios) -> evidence.Judgement:
    return evidence.Judgement([evidence.Finding("leaf", ".params['w']", None, 1.0, r, f"leaf differs: {r}x")
                               for r in ratios])


def test_evidence_across_platforms_is_inconclusive_at_any_precision_unless_an_integer_leaf_differs():
    for precision in ("default", "highest"):
        on_tpu = {"platform": {**TPU, "matmul_precision": precision}}
        status, detail = layouts.verdict_of(_evidence(1e4), on_tpu)
        assert status == "inconclusive", precision
        assert f"recorded on TPU v5 lite at {precision} matmul precision, verified on cpu: leaf differs" in detail
        assert "only a replay on the recording platform decides it" in detail
        counter = evidence.Finding("leaf", ".step", None, 1.0, math.inf, "leaf .step differs", exact=True)
        both = evidence.Judgement([counter] + _evidence(1e4).findings)
        assert layouts.verdict_of(both, on_tpu) == ("fail", "leaf .step differs"), precision
    assert layouts.verdict_of(_evidence(1e4), {})[0] == "fail", "a manifest from before platforms: this one"
    passed = layouts.verdict_of(evidence.Judgement(largest=0.5, deciding=3), {"platform": TPU})
    assert passed[0] == "pass" and "verified on cpu" in passed[1]


def test_an_integer_leafs_summaries_allow_a_tpus_square_root_but_not_another_count():
    """Adam's count at step 164: its norm, a float32 square root, read 163.99998 on a TPU v5e and 164.0 on CPU."""
    replayed = {".opt_state[0].count": [164.0, 164.0]}
    on_tpu = evidence.judge_summaries({".opt_state[0].count": [164.0, 163.99998474121094]}, [replayed],
                                      {".opt_state[0].count": 1}, {".opt_state[0].count"}, 164)
    assert on_tpu.findings == []
    another = evidence.judge_summaries({".opt_state[0].count": [165.0, 165.0]}, [replayed],
                                       {".opt_state[0].count": 1}, {".opt_state[0].count"}, 164)
    assert [f.exact for f in another.findings] == [True] and another.status == "fail"


def _flip_first_bias_moment(state):
    """One sign flipped in the first moment of one small leaf (a bias)."""
    adam = state.opt_state[0]
    mu = jax.tree_util.tree_map_with_path(
        lambda path, leaf: -leaf if jax.tree_util.keystr(path) == "['Dense_1']['bias']" else leaf, adam.mu)
    return state.replace(opt_state=(adam._replace(mu=mu),) + tuple(state.opt_state[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["default", "highest"])
def test_a_tpu_recorded_run_verified_on_cpu(trained_copy, precision):
    config = trained_copy(**RUN)
    tamper.rewrite_step(config, 20, _flip_first_bias_moment, keep_saved_fingerprints=False)
    _recorded_on(config.workdir, {**TPU, "matmul_precision": precision})
    found = tamper.verify_in_process(config.workdir, mesh=helpers.MESHES["data=2,model=4"])
    assert (found[10]["level"], found[10]["status"]) == ("reproduced", "pass"), found[10]["detail"]
    assert "recorded on TPU v5 lite" in found[10]["detail"] and "verified on cpu" in found[10]["detail"]
    assert found[20]["status"] == "inconclusive", found[20]["detail"]
    assert ".mu['Dense_1']['bias']" in found[20]["detail"], found[20]["detail"]


@pytest.mark.slow
def test_on_the_recording_platform_a_single_leaf_differs_bit_for_bit(trained_copy):
    """The values themselves are compared, not their fingerprints: one element of one leaf, by one ulp."""
    config = trained_copy(**RUN)

    def one_ulp(state):
        bias = state.params["Dense_0"]["bias"]
        nudged = bias.at[0].set(jnp.nextafter(bias[0], jnp.inf))
        return state.replace(params={**state.params, "Dense_0": {**state.params["Dense_0"], "bias": nudged}})

    tamper.rewrite_step(config, 20, one_ulp, keep_saved_fingerprints=False)
    found = tamper.verify_in_process(config.workdir, mesh=config.mesh)
    assert (found[10]["status"], found[20]["status"]) == ("pass", "fail"), found[20]["detail"]
    assert found[20]["mismatch"]["where"] == ".params['Dense_0']['bias']", found[20]["detail"]
    assert "bit for bit" in found[20]["detail"]
