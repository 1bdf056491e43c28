"""Code identity: what computed a run's numbers, recorded in every manifest (config["code"]).

What decides is `computation`: the sha256s of the jaxprs of the init, the step and the batch function
(trainer/program.py `computation`, trainer/computation.py), the same on every mesh, process count and
platform for the same program, and different when the math is (a schedule, a loss term, a dtype), in
whichever file it was edited. Beside it, for people, not deciding: the project's version, the model spec's
module and a sha256 of the source files its functions and module class live in, and the git commit and
dirty flag of the repository holding the spec (read with `git` in a subprocess, bounded; nothing when the
code is not in a repository); a README commit, a copy inside another repository or a pip install changes
those and not the computation. A resume whose computation differs from the newest checkpoint's warns on
one line naming what changed, or (--refuse_code_change) is refused; either way the new manifests record
the new identity and what it changed from (`changed_from`: the verifier starts a new chain of proofs at
the first such save). A manifest from before the computation was recorded is compared by the old rule,
the informational fields (LEGACY_COMPARED), since nothing else says what computed it.
"""

import hashlib
import importlib.metadata
import inspect
import os
import subprocess

from trainer import models
from trainer.config import CODE_FIELD, ConfigError, TrainConfig

GIT_TIMEOUT_SECS = 5.0
COMPUTATION = "computation"  # {"init", "step", "batch"}: sha256s of their jaxprs; what decides
# Shown beside a computation change, and compared only where a side records no computation (the rule of
# manifests from before it); git_dirty never (any edit anywhere in the checkout flips it).
LEGACY_COMPARED = ("version", "spec_module", "spec_sha256", "git_commit")


def project_version() -> str:
    try:
        return importlib.metadata.version("jax-checkpoint-service")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def spec_files(spec: models.ModelSpec, config: TrainConfig) -> list[str]:
    """The source files of the spec's functions and of the module class it builds."""
    objects = [spec.make_module, spec.loss, spec.synthetic_batch, spec.init_inputs, spec.check_config,
               spec.partition, spec.make_optimizer, type(spec.make_module(config))]
    files = set()
    for obj in objects:
        try:
            path = inspect.getsourcefile(obj) if obj is not None else None
        except TypeError:  # a builtin or a C function
            path = None
        if path and os.path.isfile(path):
            files.add(os.path.realpath(path))
    return sorted(files)


def _git(directory: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_SECS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def identity(config: TrainConfig, computation: dict[str, str] | None = None) -> dict:
    """The code identity of `config`'s run in this process (JSON); `computation`: trainer/program.py's
    `computation(config)`, what decides (None: not recorded, for a caller that traces nothing)."""
    spec = models.resolve(config.model)
    files = spec_files(spec, config)
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    code = {"version": project_version(), "spec_module": config.model.partition(":")[0] if ":" in config.model
            else models._BUILT_IN_PATHS[config.model].partition(":")[0],
            "spec_files": [os.path.basename(path) for path in files], "spec_sha256": digest.hexdigest()}
    directory = os.path.dirname(files[0]) if files else os.getcwd()
    commit = _git(directory, "rev-parse", "HEAD")
    if commit:
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        code["git_commit"] = commit.strip()
        if status is not None:
            code["git_dirty"] = bool(status.strip())
    if computation is not None:
        code[COMPUTATION] = dict(computation)
    return code


def _short(value) -> str:
    return str(value)[:12]


def changes(previous: dict | None, current: dict | None) -> list[str]:
    """What differs between two identities (a recorded one first), as 'name old -> new'; empty: the same
    computation. Where both record a computation it alone decides, and the informational fields that differ
    follow it to say where it may come from; where either records none, the informational fields decide
    (LEGACY_COMPARED). Either identity missing or not a dict: nothing to compare, empty."""
    if not isinstance(previous, dict) or not isinstance(current, dict):
        return []
    informational = [f"{name} {_short(previous.get(name))} -> {_short(current.get(name))}" for name in LEGACY_COMPARED
                     if previous.get(name) != current.get(name)]
    before, now = previous.get(COMPUTATION), current.get(COMPUTATION)
    if not (isinstance(before, dict) and isinstance(now, dict)):
        return informational
    # Strings compared for equality: a damaged (non-string) part is unequal to any digest, never equal by accident.
    parts = [f"{COMPUTATION}.{part} {_short(before.get(part))} -> {_short(now.get(part))}"
             for part in sorted(set(before) | set(now))
             if not (isinstance(before.get(part), str) and before.get(part) == now.get(part))]
    return parts + informational if parts else []


def check_resume(config: TrainConfig, previous_config: dict | None, current: dict) -> dict:
    """The identity to record: `current`, with `changed_from` naming what differs from the newest
    checkpoint's. A ConfigError (nothing changed yet) when --refuse_code_change forbids it."""
    differ = changes((previous_config or {}).get(CODE_FIELD), current)
    if not differ:
        return current
    if config.refuse_code_change:
        raise ConfigError("--refuse_code_change: the newest checkpoint was computed by other code: "
                          + "; ".join(differ))
    return {**current, "changed_from": differ}
