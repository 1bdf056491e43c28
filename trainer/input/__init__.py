"""File-backed input whose position is the step: ArrayRecord files read through Grain.

    records.py   RecordDataset (a glob's files by global index), its identity, check_same
    digests.py   the files' content digests (sha256), checked by stat or in full, and this host's cache
    order.py     rows_of_step: a per-epoch permutation keyed by (seed, epoch), exact epoch boundaries
    pipeline.py  RecordBatches: step -> the global batch, each process reading only its own rows
    corpus.py    prepare's text collection and tokenizers; shards.py: writing the shards
    errors.py    the typed one-line errors (ValueErrors: exit 2 at start-up)
See docs/data.md.
"""

from trainer.input.digests import CHECKS, FULL, STAT  # noqa: F401
from trainer.input.errors import (ContentChangedError, CorpusError, DataError, DatasetChangedError,  # noqa: F401
                                  NoRecordFilesError, RecordFileError)
from trainer.input.order import Order, rows_of_step  # noqa: F401
from trainer.input.pipeline import RecordBatches, local_row_ranges, record_batches  # noqa: F401
from trainer.input.records import RecordDataset, check_same, has_content, open_records, parse_flag  # noqa: F401
