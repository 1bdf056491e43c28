"""trainer.train with one process's file writes capped (RLIMIT_FSIZE): a real write fault on one host of a pod.

    WRITE_LIMITED_PROCESS=1 WRITE_LIMIT_BYTES=4096 python -m launch.local --module=tests.write_limited_train -- ...

In the named process a write past the limit fails with EFBIG ("File too large"; SIGXFSZ is ignored, so the
kernel returns the error instead of killing the process), as a full or failing disk on one host would.
"""

import os
import resource
import runpy
import signal
import sys

if f"--process_id={os.environ.get('WRITE_LIMITED_PROCESS', '')}" in sys.argv:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(os.environ["WRITE_LIMIT_BYTES"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
runpy.run_module("trainer.train", run_name="__main__", alter_sys=True)
