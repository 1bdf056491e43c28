"""Code identity: what computed a run's numbers, recorded in every manifest (config["code"]).

The project's version, the model spec's module and a sha256 of the source files its functions and
module class live in, and the git commit and dirty flag of the repository holding the spec (read with
`git` in a subprocess, bounded; nothing when the code is not in a repository). A resume whose identity
differs from the newest checkpoint's warns on one line naming what changed, or (--refuse_code_change)
is refused; either way the new manifests record the new identity and what it changed from.
"""

import hashlib
import importlib.metadata
import inspect
import os
import subprocess

from trainer import models
from trainer.config import CODE_FIELD, ConfigError, TrainConfig

GIT_TIMEOUT_SECS = 5.0
# Recorded but not compared: git_dirty (any edit anywhere in the checkout flips it; the spec hash is what counts).
COMPARED = ("version", "spec_module", "spec_sha256", "git_commit")


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


def identity(config: TrainConfig) -> dict:
    """The code identity of `config`'s run in this process (JSON)."""
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
    return code


def changes(previous: dict | None, current: dict) -> list[str]:
    """What differs between two identities, as 'name old -> new' (empty: the same code)."""
    if not previous:
        return []
    short = lambda value: str(value)[:12]
    return [f"{name} {short(previous.get(name))} -> {short(current.get(name))}" for name in COMPARED
            if previous.get(name) != current.get(name)]


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
