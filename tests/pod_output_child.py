"""A pod process that writes its stdout a piece at a time with a stderr line in between, as XLA's C++
(gloo's "connected to 1 peer ranks" line) and a Python error line can (tests/test_pod_output.py)."""

import os
import sys
import time

if __name__ == "__main__":
    os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : ")
    time.sleep(0.2)
    sys.stderr.write("error: the refusal, one line\n")
    sys.stderr.flush()
    time.sleep(0.2)
    os.write(1, b"1\n")
