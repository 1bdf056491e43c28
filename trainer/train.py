"""Entry point: python -m trainer.train --workdir=DIR [--mesh=data=4,model=2] [--model=transformer] ...

Kept short on purpose: flags in, a config out, and trainer.loop.train does the work (tests call
that same function).
"""

import sys

import jax
from absl import app, logging

from checkpointing.errors import BadCheckpointRequest, CheckpointError
from launch import distributed, exit_codes, logs
from launch.preemption import Preempted
from trainer import flags as trainer_flags
from trainer import loop
from trainer.config import validate


def main(argv: list[str]) -> None:
    logs.quiet_library_logs()
    if len(argv) > 1:
        exit_codes.exit_bad_input(ValueError(f"unexpected arguments: {' '.join(argv[1:])}"))
    try:
        distributed.initialize()
        config = validate(trainer_flags.config_from_flags(), jax.device_count())
    except ValueError as err:  # ConfigError included
        exit_codes.exit_bad_input(err)
    try:
        loop.train(config)
    except Preempted as preempted:
        logging.warning("%s: exiting with %d so the scheduler requeues the job", preempted, exit_codes.PREEMPTED)
        sys.exit(exit_codes.PREEMPTED)
    except BadCheckpointRequest as err:
        exit_codes.exit_bad_input(err)
    except CheckpointError as err:
        logging.error("%s: %s", type(err).__name__, err)
        sys.exit(exit_codes.FAILURE)


if __name__ == "__main__":
    app.run(main, flags_parser=exit_codes.parse_flags_or_exit)
