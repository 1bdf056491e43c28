"""The runs the verifier tests prove, and the damage done to their steps on purpose.

Each run is trained once per session (conftest.trained_runs) and copied into every test that
uses it (conftest.trained_copy), so a test may damage its copy freely.
"""

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from checkpointing import manifest as manifest_lib
from checkpointing import verdicts
from checkpointing import workdir as workdir_lib
from tests import helpers
from trainer.program import build_mesh, build_program
from verifier.verifier import Verifier, VerifierOptions

RUN = {**helpers.SHARED_RUN, "steps": 30}  # commits 10, 20, 30
RUN_40 = {**RUN, "steps": 40}
RUN_10 = {**RUN, "steps": 10}
# The wide mlp whose genuine steps failed the full proof's state rule across layouts (issue 23): saves
# 12 and 24 (tests/test_resume_proof.py, tests/test_init_proof.py share the one trained run).
WIDE = {**RUN, "steps": 24, "save_every_steps": 12, "input_dim": 1024, "hidden_dim": 2048, "num_layers": 2, "seed": 4}


def verify_in_process(workdir, mesh=(("data", 8),)) -> dict[int, dict]:
    Verifier(VerifierOptions(workdir=workdir, mesh=mesh)).verify_pending()
    return verdicts.read_all(workdir)


def rewrite_step(config, step, mutate, *, keep_saved_fingerprints):
    """Replaces `step` with a mutated copy of its state (a real Orbax save of the new arrays).

    keep_saved_fingerprints=True models corruption after the save (the manifest still describes
    the original arrays); False models a trainer bug that saved the wrong state consistently.
    """
    program = build_program(config, build_mesh(config))
    restored = helpers.open_service(config, program).restore(step, program.abstract_state)
    state = mutate(restored.state)
    shutil.rmtree(helpers.checkpoint_dir(config.workdir, str(step)))
    service = helpers.open_service(config, program)
    service.save(step, state, losses=manifest_lib.losses(restored.manifest), reason=restored.manifest["reason"])
    service.wait_until_finished()
    if keep_saved_fingerprints:
        with open(workdir_lib.manifest_file(config.workdir, step), "w") as f:
            json.dump(restored.manifest, f)


def edit_manifest(workdir, step, edit):
    path = workdir_lib.manifest_file(workdir, step)
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def truncate_data_files(workdir, step):
    """Cuts every array data file of `step` to 8 bytes: its manifest intact, its arrays unreadable."""
    pattern = os.path.join(helpers.checkpoint_dir(workdir, str(step)), workdir_lib.STATE_ITEM, "**", "d", "*")
    for data_file in glob.glob(pattern, recursive=True):
        with open(data_file, "r+b") as f:
            f.truncate(8)


def _leaf(state, path):
    return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}[path]


def _replace_leaves(state, replacements: dict):
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [replacements.get(jax.tree_util.keystr(p), leaf) for p, leaf in flat]
    return jax.tree.unflatten(treedef, leaves)


KERNEL = ".params['Dense_1']['kernel']"
MU_KERNEL = ".opt_state[0].mu['Dense_1']['kernel']"


def flip_one_bit(state):
    kernel = _leaf(state, KERNEL)
    host = np.array(kernel)
    host.view(np.uint32)[3, 7] ^= 1 << 4
    return _replace_leaves(state, {KERNEL: jax.device_put(host, kernel.sharding)})


def swap_same_shaped_leaves(state):
    kernel, mu_kernel = _leaf(state, KERNEL), _leaf(state, MU_KERNEL)
    return _replace_leaves(state, {KERNEL: jnp.copy(mu_kernel), MU_KERNEL: jnp.copy(kernel)})


def zero_adam_moments(state):
    adam = state.opt_state[0]
    zeroed = adam._replace(mu=jax.tree.map(jnp.zeros_like, adam.mu), nu=jax.tree.map(jnp.zeros_like, adam.nu))
    return state.replace(opt_state=(zeroed,) + tuple(state.opt_state[1:]))


def swap_adam_moments(state):
    adam = state.opt_state[0]
    return state.replace(opt_state=(adam._replace(mu=jax.tree.map(jnp.copy, adam.nu),
                                                  nu=jax.tree.map(jnp.copy, adam.mu)),) + tuple(state.opt_state[1:]))


def perturb_params(state):
    """Every parameter scaled by 1 + 1e-3 * noise: a small, plausible-looking wrong state."""
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [leaf * (1 + 1e-3 * jax.random.normal(key, leaf.shape, leaf.dtype)) for leaf, key in zip(leaves, keys)]
    return state.replace(params=jax.tree.unflatten(treedef, noisy))


def change_step_counter(state):
    return state.replace(step=state.step + 1)


def nan_in_one_leaf(state):
    kernel = _leaf(state, KERNEL)
    host = np.array(kernel)
    host[0, 0] = np.nan
    return _replace_leaves(state, {KERNEL: jax.device_put(host, kernel.sharding)})
