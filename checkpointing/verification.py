"""What a verifier needs from the service, public for our verifier and launchers (docs/api.md): the
checked restore onto another mesh, manifests, verdicts, comparisons, content digests, probes and the
replay protocol. Thin: the implementation is checkpointing/_src/."""
# ruff: noqa: F401  (re-exports)
from checkpointing._src import (compare, content, durable, manifest, marking, marks, plot, plot_draw, probes, replay,
                                restore, run_record, verdicts, workdir)
from checkpointing._src.compare import leaf_differences, relative_difference
from checkpointing._src.input_state import read_input_states
from checkpointing._src.report import recorded_losses
from checkpointing._src.service import CheckpointService
from checkpointing._src.storage import check_workdir
from checkpointing._src.workdir import committed_steps, is_committed, read_manifest
