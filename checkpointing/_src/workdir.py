"""Every path in a run's workdir, named once (local path, gs:// or s3://: object_store.py):

    <workdir>/checkpoints/<step>/state/          the arrays (Orbax, TensorStore)
    <workdir>/checkpoints/<step>/manifest/metadata   the manifest (JSON: fingerprints, losses, config)
    <workdir>/checkpoints/<step>/input_state/process_<i>-of-<n>.json   a data iterator's state (input_state.py)
    <workdir>/run.json                           the run's identity, recorded once at its first start (run_record.py)
    <workdir>/superseded/<step>-<time>[.verdict.json]  steps a resume from an older step set aside
    <workdir>/verdicts/<step>.json               the verifier's verdict on one committed step
    <workdir>/probes/<step>.json                 what the trainer recorded k steps after a save (probes.py)
    <workdir>/lease/<generation>.json            who may write this workdir (checkpointing/_src/lease.py)
    <workdir>/metrics.jsonl, tensorboard/        the trainer's per-step metrics and event files

A process's local directory (--local_dir, '{process}' expanded: expand_local_dir) is a workdir of
its own holding only that process's local steps (checkpointing/_src/local_tier.py), laid out the same:
    <local_dir>/checkpoints/<step>/state/            the shards this process holds
    <local_dir>/checkpoints/<step>/manifest/metadata  the manifest (tier "local", this process's layout)

Orbax owns checkpoints/ alone: on an object store it treats every directory without a commit marker in its
root as a killed save and deletes it, which would take verdicts or the lease with it.
"""

import os
import re
import shutil
import time

from etils import epath

from checkpointing.config import ConfigError
from checkpointing._src import durable, object_store, reads
from checkpointing.errors import CorruptCheckpointError

CHECKPOINTS_DIR = "checkpoints"
STATE_ITEM = "state"  # Orbax item of the arrays inside a step
MANIFEST_ITEM = "manifest"  # Orbax item of the manifest inside a step
# The manifest's file name inside its item: Orbax's JSON handler default, set explicitly so a change
# of that default cannot hide every existing manifest.
MANIFEST_FILE = "metadata"
SUPERSEDED_DIR = "superseded"
VERDICTS_DIR = "verdicts"
PROBES_DIR = "probes"  # what the trainer recorded a few steps after each save (checkpointing/_src/probes.py)
LEASE_DIR = "lease"
RUN_FILE = "run.json"  # the run's identity, written once at its first start (checkpointing/_src/run_record.py)
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PROCESS_PLACEHOLDER = "{process}"  # in --local_dir: the process index


def fresh_path(directory: str) -> epath.Path:
    """epath.Path(directory), with any cached object-store listing dropped first (object_store.py)."""
    object_store.drop_cached_listings(directory)
    return epath.Path(directory)


def _join(workdir: str, *parts: str) -> str:
    return "/".join([str(workdir).rstrip("/"), *parts])


def checkpoints_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, CHECKPOINTS_DIR))


def step_dir(workdir: str, step: int) -> epath.Path:
    return epath.Path(_join(workdir, CHECKPOINTS_DIR, str(step)))


def manifest_file(workdir: str, step: int) -> epath.Path:
    return step_dir(workdir, step) / MANIFEST_ITEM / MANIFEST_FILE


def superseded_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, SUPERSEDED_DIR))


def verdicts_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, VERDICTS_DIR))


def verdict_file(workdir: str, step: int) -> epath.Path:
    return verdicts_dir(workdir) / f"{step}.json"


def probes_dir(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, PROBES_DIR))


def probe_file(workdir: str, step: int) -> epath.Path:
    return probes_dir(workdir) / f"{step}.json"


def lease_dir(workdir: str) -> str:
    """A string: the lease store takes object-store URLs and local paths as they are."""
    return _join(workdir, LEASE_DIR)


def run_file(workdir: str) -> epath.Path:
    return epath.Path(_join(workdir, RUN_FILE))


def metrics_file(workdir: str) -> str:
    return _join(workdir, METRICS_FILE)


def tensorboard_dir(workdir: str) -> str:
    return _join(workdir, TENSORBOARD_DIR)


def expand_local_dir(template: str, process_index: int) -> str:
    """One process's local directory: '{process}' replaced by its index (processes sharing a machine,
    as the local pod launcher's do, need their own). Without it the path is used as it is: each host
    of a real pod has its own disk. Any other '{...}' is a ConfigError naming it (a mistyped placeholder
    would put every process in one directory)."""
    unknown = sorted(set(re.findall(r"\{[^{}]*\}", str(template))) - {PROCESS_PLACEHOLDER})
    if unknown:
        raise ConfigError(f"--local_dir={template}: unknown placeholder {', '.join(unknown)} "
                          f"(only {PROCESS_PLACEHOLDER} is expanded)")
    return str(template).replace(PROCESS_PLACEHOLDER, str(process_index))


# --- what a workdir holds -------------------------------------------------------------------------

class Workdir(str):
    """A run's workdir opened once (its path, so it goes wherever a path does): the committed steps listed
    once and each manifest read once, however many readers of a start-up ask (the restore's candidates, the
    run's identity, `init_from`, the trainer's data and code checks, its status line; each a round trip on
    an object store). Read only: what the opener itself changes (steps set aside) it says with `changed()`, and once
    the start-up is over `live()` makes every later answer a fresh read (background commits, retention)."""

    def __new__(cls, path: str):
        opened = super().__new__(cls, path)
        opened._steps, opened._manifests, opened._live = None, {}, False
        return opened

    def committed_steps(self) -> list[int]:
        """Finalized steps, ascending (in-flight and killed saves are not listed)."""
        if self._live or self._steps is None:
            steps = _list_committed(self)
            if self._live:
                return steps
            self._steps = steps
        return list(self._steps)

    def read_manifest(self, step: int) -> dict:
        """The schema-checked manifest of a committed `step` (shared: read it, do not change it)."""
        if self._live or step not in self._manifests:
            manifest = _read_manifest(self, step)
            if self._live:
                return manifest
            self._manifests[step] = manifest
        return self._manifests[step]

    def changed(self) -> None:
        """The opener moved or removed steps: list again, and read again what is listed then."""
        self._steps, self._manifests = None, {}

    def live(self) -> None:
        """The start-up is over (the first step is done): from now on every answer is read afresh."""
        if not self._live:
            self._live = True
            self.changed()


def committed_steps(directory: str) -> list[int]:
    """Finalized steps in `directory`, ascending; in-flight and killed saves are not listed (a Workdir's
    answer, read once per start-up, when `directory` is one)."""
    if isinstance(directory, Workdir):
        return directory.committed_steps()
    return _list_committed(directory)


def _list_committed(directory: str) -> list[int]:
    fresh_path(directory)
    path = checkpoints_dir(directory)
    if not path.exists():
        return []
    import orbax.checkpoint as ocp  # imports JAX: the paths above must not (trainer.config uses them)

    from checkpointing._src import orbax_s3  # noqa: F401  (an s3:// step is committed by its marker, as on gs://)

    if object_store.is_object_store(path):  # Orbax checks each step's marker on a thread pool: the round trips overlap
        return sorted(ocp.path.step.checkpoint_steps(path))
    # On a local disk Orbax's check is a name test and a stat, but each call runs it as a coroutine on an
    # event loop of its own (about 1 ms a step here, and a relaunch lists about 8 times): the same test,
    # as plain calls, where Orbax's check for the path is an atomic rename's (_finalized_check).
    finalized = _finalized_check(path)
    return sorted(ocp.path.step.step_from_checkpoint_name(entry.name) for entry in path.iterdir()
                  if _step_named(entry.name) and finalized(entry))


def _finalized_check(path):
    """Orbax's test of whether a step directory under `path` is finalized, as a plain function: for an atomic
    rename (Orbax's default off GCS, and the service's DurableRename) its validate_final is a name without the
    temporary suffix and a directory (tests/test_workdir.py compares the two); any other kind, Orbax's call,
    which checks what that kind calls finalized itself."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import atomicity, atomicity_defaults

    from checkpointing._src import orbax_s3  # noqa: F401  (as above)

    if issubclass(atomicity_defaults.get_default_temporary_path_class(path), atomicity.AtomicRenameTemporaryPath):
        return lambda entry: atomicity.TMP_DIR_SUFFIX not in entry.name and entry.is_dir()
    return ocp.path.step.is_path_finalized


def _step_named(name: str) -> bool:
    return name.isdigit() or name.split("_")[-1].isdigit()  # as orbax.checkpoint's _is_legacy_step_checkpoint


def linked_steps(directory: str) -> dict[str, str]:
    """{path: target} of the entries of a local `directory`'s checkpoints/ that are symbolic links."""
    path = checkpoints_dir(directory)
    if object_store.is_object_store(directory) or not path.is_dir():
        return {}
    return {str(entry): os.readlink(entry) for entry in path.iterdir() if os.path.islink(entry)}


def move_aside(directory: str, steps: list[int], *, only_present: bool = False) -> None:
    """Moves each step and its verdict to <directory>/superseded/<step>-<time>[.verdict.json], durably (the
    run will save new steps under those numbers). `only_present`: skip a step this directory lacks."""
    superseded = superseded_dir(directory)
    durable.make_dirs(superseded)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for step in steps:
        if only_present and not step_dir(directory, step).exists():
            continue
        step_dir(directory, step).rename(superseded / f"{step}-{stamp}")
        verdict = verdict_file(directory, step)
        if verdict.exists():
            verdict.rename(superseded / f"{step}-{stamp}.verdict.json")
    if isinstance(directory, Workdir):
        directory.changed()
    if durable.is_local(superseded):
        for moved_from_and_to in (checkpoints_dir(directory), verdicts_dir(directory), superseded):
            if moved_from_and_to.exists():
                durable.sync_dir(moved_from_and_to)


def remove_killed_saves(directory: str) -> list[str]:
    """Removes the temporary step directories of saves that never committed (killed, or failed on a full disk)
    from a local `directory`; returns their names. Only a writer about to hold the workdir calls it: Orbax does
    the same once a writer opens it, but a disk those saves filled would refuse the lease first. On an object
    store there is no directory to fill, and Orbax alone judges what is uncommitted there."""
    path = checkpoints_dir(directory)
    if object_store.is_object_store(directory) or not path.is_dir():
        return []
    from orbax.checkpoint._src.path import atomicity  # imports JAX, as above

    removed = [entry for entry in path.iterdir() if atomicity.TMP_DIR_SUFFIX in entry.name]
    for entry in removed:
        shutil.rmtree(entry)
    return [entry.name for entry in removed]


def is_committed(directory: str, step: int) -> bool:
    """Whether `step` is finalized in `directory`: committed_steps' answer for one step, without listing
    (Orbax's listing starts a thread pool each time: about 4 ms; this is a stat on a local disk)."""
    fresh_path(directory)
    path = step_dir(directory, step)
    return _finalized_check(path.parent)(path)


def read_manifest(directory: str, step: int) -> dict:
    """The schema-checked manifest of `step` (the caller knows the step is committed; read once per start-up
    when `directory` is a Workdir). A manifest that records another step than its directory's name (a step
    copied in under another number) is corrupt: this is the one place that knows both."""
    if isinstance(directory, Workdir):
        return directory.read_manifest(step)
    return _read_manifest(directory, step)


def _read_manifest(directory: str, step: int) -> dict:
    path = manifest_file(directory, step)
    try:
        text = reads.read_retrying(path.read_text, f"step {step}: reading its manifest {path}")
    except CorruptCheckpointError as err:  # missing: a killed save's directory renamed by hand, a lost file
        raise CorruptCheckpointError(f"step {step}: cannot read its manifest ({err.__cause__})") from None
    from checkpointing._src import manifest as manifest_lib  # imports JAX, as above

    manifest = manifest_lib.parse(text, f"step {step} manifest")
    if manifest["step"] != step:
        raise CorruptCheckpointError(f"step {step}: its manifest records step {manifest['step']} ({path}): a step "
                                     "saved under another number")
    return manifest
