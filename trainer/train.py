"""Entry point: python -m trainer.train --workdir=DIR [--mesh=data=4,model=2] [--model=transformer] ...

Kept short on purpose: flags in, a config out, and trainer.loop.train does the work (tests call
that same function). Exit 0 done; 75 preempted (requeue); 2 bad input, one `error:` line; 1 a
fault, whose one `error:` line, last on stderr, names the step, the path and the cause.
"""

from runtime import distributed  # first, and without JAX (see distributed.hold_sigterm)

if __name__ == "__main__":
    distributed.hold_sigterm()  # from here until the runtime starts, SIGTERM is a preemption: exit 75

import os  # noqa: E402  (after the SIGTERM guard: importing JAX takes about a second)
import time  # noqa: E402

import jax  # noqa: E402

from checkpointing.inspection import check_workdir  # noqa: E402
from runtime import entry  # noqa: E402
from trainer import compile_cache  # noqa: E402
from trainer import flags as trainer_flags  # noqa: E402
from trainer import loop  # noqa: E402
from trainer.program import validate  # noqa: E402
from absl import flags  # noqa: E402

# --help lists the flags of the main module only: the trainer's are defined in trainer/flags.py (config
# fields, checkpoint policy) and runtime/distributed.py (the pod), so they are adopted as this program's
# own (--helpfull adds every library's, ~285 lines).
flags.adopt_module_key_flags(trainer_flags)
flags.adopt_module_key_flags(distributed)


def process_start_time() -> float | None:
    """The epoch time this process started (Linux /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def main(argv: list[str]) -> None:
    started, phases = time.time(), {}
    process_started = process_start_time()
    if process_started is not None:
        phases["process_start"] = max(started - process_started, 0.0)
    begin = time.perf_counter()
    distributed.initialize()
    phases["distributed_start"] = time.perf_counter() - begin
    opened_at = time.perf_counter()  # the `open` phase: the checks, the workdir, the lease, the program
    parts = loop.OpenParts(opened_at)
    device_count = jax.device_count()  # the devices' client starts here (a TPU's took 7.6 s)
    parts.mark("devices")
    config = validate(trainer_flags.config_from_flags(), device_count)
    parts.mark("validate")
    check_workdir(config.workdir, must_exist=False)  # bounded: an unreachable gs:// or s3:// endpoint is one line
    cache_dir = trainer_flags.COMPILATION_CACHE_DIR.value  # after the checks: bad input creates nothing
    compile_cache.use(compile_cache.default_dir() if cache_dir is None else cache_dir)
    parts.mark("workdir")
    try:
        loop.train(config, startup_phases=phases, opened_at=opened_at, open_parts=parts)
    except OSError as err:  # the disk itself, outside a save (full, read-only, gone): name the workdir
        err.filename = err.filename or config.workdir
        raise


if __name__ == "__main__":
    entry.run(main)
