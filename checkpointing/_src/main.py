"""run_main: what a training loop of one's own calls in place of absl's app.run, to behave as our trainer does."""

from typing import Callable

from runtime import entry


def run_main(main: Callable[[list[str]], int | None]) -> None:
    """Parses absl flags and runs `main(argv)` under the trainer's exit codes (runtime/entry.py): bad input
    (a ValueError: ConfigError, ConfigMismatchError, WorkdirLeasedError, a bad flag) is one `error:` line and
    exit 2, nothing changed; Preempted exits 75; a fault (CheckpointError, OSError) one `error:` line and exit
    1; `main`'s return value (None: 0) otherwise. Orbax's, TensorStore's and JAX's INFO records are shown at
    --v=1 only, each library record as one line (runtime/logs.py). Never returns."""
    entry.run(main)
