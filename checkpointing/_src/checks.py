"""The checks every restore makes, each raising a typed error that names what differs.

Config and tree are checked against the manifest before any array is read; fingerprints after.
"""

from checkpointing._src import manifest as manifest_lib
from checkpointing._src import marks as marks_lib
from checkpointing.errors import ConfigMismatchError, FingerprintMismatchError, TreeMismatchError
from checkpointing._src.run_metadata import RunMetadata


def check_config_matches(step: int, manifest: dict, run: RunMetadata) -> None:
    """ConfigMismatchError naming every fixed field that differs between the checkpoint and `run`."""
    if manifest["fixed_hash"] == run.fixed_hash:
        return
    saved, current = manifest["fixed_fields"], run.fixed_fields
    differing = sorted(name for name in set(saved) | set(current) if saved.get(name) != current.get(name))
    details = ", ".join(f"{name}: checkpoint {saved.get(name)!r} vs this run {current.get(name)!r}"
                        for name in differing)
    raise ConfigMismatchError(f"step {step} was saved with a different config ({details or 'hash differs'})")


def check_tree_matches(step: int, manifest: dict, abstract_state) -> None:
    """TreeMismatchError naming every path added, removed, reshaped or retyped."""
    saved = {path: (leaf["shape"], leaf["dtype"]) for path, leaf in manifest["leaves"].items()}
    target = {path: (leaf["shape"], leaf["dtype"]) for path, leaf in manifest_lib.leaf_table(abstract_state).items()}
    problems = [f"{p} missing from the checkpoint" for p in sorted(set(target) - set(saved))]
    problems += [f"{p} not in this program" for p in sorted(set(saved) - set(target))]
    for path in sorted(set(saved) & set(target)):
        (saved_shape, saved_dtype), (shape, dtype) = saved[path], target[path]
        if saved_shape != shape:
            problems.append(f"{path} shape {saved_shape} in the checkpoint vs {shape}")
        if saved_dtype != dtype:
            problems.append(f"{path} dtype {saved_dtype} in the checkpoint vs {dtype}")
    if problems:
        raise TreeMismatchError(f"step {step} does not match this program's state: " + "; ".join(problems))


def check_fingerprints(step: int, manifest: dict, state) -> None:
    """FingerprintMismatchError naming the first leaf whose fingerprint differs (exact)."""
    actual = marks_lib.fingerprints_of(state)
    bad = [path for path, leaf in manifest["leaves"].items() if actual.get(path) != leaf["fingerprint"]]
    if bad:
        first = bad[0]
        expected = manifest["leaves"][first]["fingerprint"]
        raise FingerprintMismatchError(
            f"step {step}: leaf {first} fingerprint {actual.get(first)} != saved {expected} "
            f"({len(bad)} leaf(s) differ: {', '.join(bad)})", path=first, expected=expected, actual=actual.get(first))
