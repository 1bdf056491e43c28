"""What a run's workdir holds, read only: the public names our trainer's metrics and `inspect` read a run
through (its steps, manifests, history, verdicts' summary, tables and plots; docs/api.md). Thin: the
implementation is checkpointing/_src/."""
# ruff: noqa: F401  (re-exports)
from checkpointing._src.history import attempt_record, last_attempt_id, layout_of, read_history
from checkpointing._src.input_state import read_input_states
from checkpointing._src.plot import FORMATS as PLOT_FORMATS, series as plot_series, proof_series, reference_loss
from checkpointing._src.plot import summary as plot_summary, title as plot_title
from checkpointing._src.plot_draw import draw as draw_plot
from checkpointing._src.report import format_table, table_rows
from checkpointing._src.storage import check_workdir
from checkpointing._src.verdicts import newest_proved_step
from checkpointing._src.workdir import (committed_steps, expand_local_dir, metrics_file, read_manifest,
                                        tensorboard_dir)
