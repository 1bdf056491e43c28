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

from checkpointing._src import fingerprint as fingerprint_lib
from checkpointing._src import manifest as manifest_lib
from checkpointing._src import verdicts
from checkpointing._src import workdir as workdir_lib
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


BIAS = ".params['Dense_1']['bias']"
MU_BIAS = ".opt_state[0].mu['Dense_1']['bias']"


def scale_one_leaf(path: str = KERNEL, size: float = 1e-3):
    """A mutation: the leaf at `path` times (1 + size * noise), every other leaf as it was."""

    def mutate(state):
        leaf = _leaf(state, path)
        noisy = leaf * (1 + size * jax.random.normal(jax.random.key(11), leaf.shape, leaf.dtype))
        return _replace_leaves(state, {path: jax.device_put(noisy, leaf.sharding)})

    return mutate


def shift_leaf(path: str, by: float):
    """A mutation: the leaf at `path` plus `by` (every element), every other leaf as it was."""

    def mutate(state):
        leaf = _leaf(state, path)
        return _replace_leaves(state, {path: leaf + jnp.asarray(by, leaf.dtype)})

    return mutate


def noisy_params(size: float):
    """A mutation: every parameter times (1 + size * noise) (perturb_params at another size)."""

    def mutate(state):
        leaves, treedef = jax.tree.flatten(state.params)
        keys = jax.random.split(jax.random.key(7), len(leaves))
        noisy = [leaf * (1 + size * jax.random.normal(key, leaf.shape, leaf.dtype)) for leaf, key in zip(leaves, keys)]
        return state.replace(params=jax.tree.unflatten(treedef, noisy))

    return mutate


def flip_one_sign(path: str = MU_BIAS):
    """A mutation: the sign of one element of the leaf at `path`, its largest in magnitude (a flipped zero
    would change nothing)."""

    def mutate(state):
        leaf = _leaf(state, path)
        host = np.array(leaf)
        index = np.unravel_index(np.argmax(np.abs(host)), host.shape)
        host[index] = -host[index]
        return _replace_leaves(state, {path: jax.device_put(host, leaf.sharding)})

    return mutate


def copy_foreign_step(source_workdir: str, source_step: int, workdir: str, as_step: int) -> None:
    """Another run's committed step (and its probe) copied into `workdir` as `as_step`, replacing what was there."""
    target = helpers.checkpoint_dir(workdir, str(as_step))
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(helpers.checkpoint_dir(source_workdir, str(source_step)), target)
    probe = workdir_lib.probe_file(workdir, as_step)
    probe.unlink(missing_ok=True)
    source_probe = workdir_lib.probe_file(source_workdir, source_step)
    if source_probe.exists():
        shutil.copyfile(source_probe, probe)


# --- the red team's forgery: arrays that collide with the recorded fingerprints ----------------------
# checkpointing/_src/fingerprint.py: each element's word is w = fmix32(bits + index * 0x9E3779B9), a bijection,
# and a leaf's lanes are sum(w) and sum(w * w) mod 2**32. Any new array keeps both lanes once three of its
# elements are solved: one word w_a chosen, then y + z = t1 and y*y + z*z = t2, i.e. (2y - t1)**2 = 2 t2 - t1**2,
# a square root mod 2**32 (Hensel lifting), and each word mapped back to bits through fmix32's inverse.

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def _unfmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 2**32)) & _MASK
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 2**32)) & _MASK
    return h ^ (h >> 16)


def _words(bits: np.ndarray) -> np.ndarray:
    index = np.arange(bits.size, dtype=np.uint32)
    h = bits.reshape(-1) + index * np.uint32(_GOLDEN)  # uint32: wraps mod 2**32 like the device's
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _odd_square_root(d: int) -> int:
    """r with r*r = d mod 2**32, for d = 1 mod 8."""
    root = 1
    for k in range(3, 32):
        if (root * root - d) % 2 ** (k + 1):
            root += 2 ** (k - 1)
    return root


def _two_words(t1: int, t2: int) -> tuple[int, int] | None:
    """(y, z) with y + z = t1 and y*y + z*z = t2 mod 2**32, where the discriminant allows it."""
    d = (2 * t2 - t1 * t1) & _MASK  # = (2y - t1)**2
    if d % 8 != 1:
        return None
    root = _odd_square_root(d)
    for u in (root, -root & _MASK, (root + 2**31) & _MASK, (-root + 2**31) & _MASK):
        for y in (((u + t1) // 2) & _MASK, (((u + t1) // 2) + 2**31) & _MASK):
            z = (t1 - y) & _MASK
            if (y * y + z * z) & _MASK == t2:
                return y, z
    return None


def _as_float(word: int, index: int) -> np.float32:
    return np.array([(_unfmix32(word) - index * _GOLDEN) & _MASK], np.uint32).view(np.float32)[0]


def _word(value: np.float32, index: int) -> int:
    return _fmix32((int(np.array([value], np.float32).view(np.uint32)[0]) + index * _GOLDEN) & _MASK)


def collide(forged: np.ndarray, fingerprint: int, rng: np.random.Generator) -> np.ndarray:
    """`forged` (float32) with two elements solved so that its fingerprint is `fingerprint`. Three more are
    drawn again at each try (the free words): for y + z odd, the lanes fix how many of the other words are odd
    mod 4 (an odd word's square is 1 mod 4), and three free words can make any count. The solved values stay
    finite and within the array's range."""
    flat = forged.astype(np.float32).reshape(-1).copy()
    lane1, lane2 = fingerprint >> 32, fingerprint & _MASK
    chosen = [int(i) for i in rng.choice(flat.size, size=5, replace=False)]
    free, (b, c) = chosen[:3], chosen[3:]
    rest = np.delete(_words(flat.view(np.uint32)), chosen).astype(np.uint64)
    rest1, rest2 = int(rest.sum()) & _MASK, int((rest * rest & _MASK).sum()) & _MASK
    bound = float(np.max(np.abs(flat)))
    for _ in range(100_000):
        words = []
        for index in free:
            flat[index] = np.float32(forged.reshape(-1)[index] * (1 + 1e-3 * rng.standard_normal()))
            words.append(_word(flat[index], index))
        solved = _two_words((lane1 - rest1 - sum(words)) & _MASK, (lane2 - rest2 - sum(w * w for w in words)) & _MASK)
        if solved is None:
            continue
        y, z = _as_float(solved[0], b), _as_float(solved[1], c)
        if np.isfinite(y) and np.isfinite(z) and abs(y) <= bound and abs(z) <= bound:
            flat[b], flat[c] = y, z
            return flat.reshape(forged.shape)
    raise RuntimeError("no collision found in 100000 tries")


FORGED_MIN_SIZE = 5  # a leaf needs three free words and two solved ones; a smaller one keeps its values


def forge_params(state, manifest: dict, size: float = 1e-2, seed: int = 0):
    """Every params leaf of FORGED_MIN_SIZE elements or more times (1 + size * noise), then made to collide
    with its recorded fingerprint (the manifest's): a state whose forged leaves differ from the saved ones and
    whose every fingerprint is the manifest's."""
    rng = np.random.default_rng(seed)
    replacements = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        key = ".params" + jax.tree_util.keystr(path)
        if leaf.size < FORGED_MIN_SIZE:
            continue
        host = np.array(leaf)
        noisy = (host * (1 + size * rng.standard_normal(host.shape))).astype(np.float32)
        replacements[key] = jax.device_put(collide(noisy, manifest["leaves"][key]["fingerprint"], rng), leaf.sharding)
    return _replace_leaves(state, replacements)


def forge_step(config, step: int, size: float = 1e-2) -> list[str]:
    """Writes forged params into `step` (forge_params), its manifest untouched; returns the forged leaves'
    paths, after checking that their fingerprints are the manifest's and their values are not the saved ones."""
    manifest = workdir_lib.read_manifest(config.workdir, step)
    forged = []

    def forge(state):
        new = forge_params(state, manifest, size)
        old, now = helpers.leaves_by_path(state.params), helpers.leaves_by_path(new.params)
        forged.extend(".params" + path for path in now if not np.array_equal(old[path], now[path]))
        prints = fingerprint_lib.fingerprint_tree(new.params)
        assert forged and all(manifest["leaves"][path]["fingerprint"] == prints[path[len(".params"):]]
                              for path in forged), "the forged leaves collide with the recorded fingerprints"
        return new

    rewrite_step(config, step, forge, keep_saved_fingerprints=True)
    return forged
