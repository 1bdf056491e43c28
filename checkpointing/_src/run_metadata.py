"""What every manifest of a run records about the run: its config, the fields a resume must not change,
their hash, the mesh, and the run's replay program and origin (kept apart from the service that writes it)."""

import dataclasses
import hashlib
import json
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class RunMetadata:
    """What every manifest of this run records about the run (the service never interprets `config`)."""

    config: dict
    fixed_fields: dict  # fields a resume must not change
    fixed_hash: str
    mesh: dict[str, int]
    program: str | None = None  # "package.module:factory" the verifier replays with (verifier/program.py)
    init_from: dict | None = None  # {"workdir", "step", "digest"}: the other run's step this one started from
    total_steps: int | None = None  # the run's last step: the verifier knows the final save while it is written

    @classmethod
    def of_run(cls, config: dict, fixed: Iterable[str], mesh: dict[str, int], **identity) -> "RunMetadata":
        """The identity of a run from its whole config (JSON) and the names of the fields a resume must
        not change; the hash is of those fields alone, so the others (cadences, the mesh) may change."""
        fixed_fields = {name: config[name] for name in fixed}
        blob = json.dumps(fixed_fields, sort_keys=True).encode()
        return cls(config=config, fixed_fields=fixed_fields, fixed_hash=hashlib.sha256(blob).hexdigest()[:16],
                   mesh=dict(mesh), **identity)
