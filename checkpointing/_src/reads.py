"""Reads of committed steps that tell an error of the storage from evidence against the step.

A step is set aside (checkpointing/_src/restore.py) or failed (the verifier) only on evidence that it is wrong:
its fingerprints, its tree, its manifest, or a file of it truncated or missing. A read that fails for the
medium (EIO, an unreachable or slow endpoint, anything not known to be damage) is retried a few times,
then raised as StorageUnavailableError: a fault of this run, exit 1, with nothing set aside.
"""

import time
from typing import Callable, TypeVar

from absl import logging

from checkpointing.errors import CorruptCheckpointError, StorageUnavailableError
from runtime.causes import names_damage, one_line_cause

READ_ATTEMPTS = 4
FIRST_RETRY_SECS = 0.25  # then 1 s and 4 s: about 5 s in all, past a blip of the disk or the network

T = TypeVar("T")


def read_retrying(read: Callable[[], T], what: str, *, attempts: int = READ_ATTEMPTS) -> T:
    """read(), retried while it fails for the storage. `what` names the step and the path ("step 30: reading
    its arrays from <path>"). CorruptCheckpointError when the failure is damage to the data;
    StorageUnavailableError once `attempts` reads failed otherwise."""
    delay = FIRST_RETRY_SECS
    for attempt in range(1, attempts + 1):
        try:
            return read()
        except Exception as err:  # Orbax, TensorStore and the OS raise what they like: classified by cause
            cause = one_line_cause(err)
            if names_damage(err):
                raise CorruptCheckpointError(f"{what} failed: {cause}") from err
            if attempt == attempts:
                raise StorageUnavailableError(
                    f"{what} failed {attempts} times: {cause}; nothing was set aside (an error of the storage is "
                    "not evidence against the step: run again once it reads)") from err
            logging.warning("%s failed (%s); attempt %d of %d in %.2fs", what, cause, attempt + 1, attempts, delay)
            time.sleep(delay)
            delay *= 4
