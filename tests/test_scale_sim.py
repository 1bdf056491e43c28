"""The multi-host protocol's scaling claims (docs/scale.md), on request counts.

The service's own pieces (benchmarks/scale_protocol.py: the lease, the listing of committed steps,
the verdict listing, the save's and restore's per-process reads) run with 4 and then 32 simulated
processes (threads with their own storage clients) against the GCS-protocol server
(tests/gcs_emulator.py counts every request), the S3 server (tests/s3_server.py, the same) and a
local disk. A piece that becomes O(hosts) per host grows 8x between the two and fails here; times
are not compared.
"""

import pytest

pytestmark = pytest.mark.slow

SMALL, LARGE = 4, 32
STEPS = 3  # committed steps in the workdir
LEASE_PIECES = ("lease_acquire", "lease_renewal", "lease_check", "lease_holder")  # one caller, exact requests
# Through gcsfs, whose existence checks race a get against a list and may skip the list: up to a request of
# jitter per file read (the verdict listing reads 2 x STEPS files: 11 requests in one run, 15 in another).
JITTERY_PIECES = ("verdict_listing", "save_check", "listing", "manifest_read")


def _simulate(workdir_base: str, counter_for) -> dict[int, dict]:
    from benchmarks import scale_protocol

    measured = {}
    for hosts in (SMALL, LARGE):  # a fresh workdir each: the lease's history is the same for both
        workdir = f"{workdir_base}-{hosts}"
        scale_protocol.make_workdir(workdir, STEPS, verified=STEPS - 1)
        measured[hosts] = {row.piece: row for row in scale_protocol.simulate(workdir, hosts, counter_for)}
    return measured


def _assert_scaling(measured: dict[int, dict]) -> None:
    small, large = measured[SMALL], measured[LARGE]
    for piece in LEASE_PIECES:  # process 0 (or one reader) whatever the pod's size: the same requests
        assert small[piece].callers == large[piece].callers == 1
        assert large[piece].requests == small[piece].requests, (
            f"{piece}: {small[piece].requests} requests with {SMALL} hosts, {large[piece].requests} with {LARGE}")
    assert small["verdict_listing"].callers == large["verdict_listing"].callers == 1
    for piece in ("save_check", "listing", "manifest_read"):
        assert large[piece].callers == LARGE and small[piece].callers == SMALL
    for piece in JITTERY_PIECES:  # each caller's requests are O(1): at most 2x from the jitter, never 8x
        per_small, per_large = small[piece].per_caller, large[piece].per_caller
        assert not (per_large > per_small * 2 + 1), (
            f"{piece}: {per_small:g} requests per process with {SMALL} hosts, {per_large:g} with {LARGE}")


def _assert_object_store_requests(measured) -> None:
    """What a bucket's pieces cost, GCS's and S3's alike: none grows per host; a lease renewal and check take the
    requests named; one pass over the committed steps (the directory, then each step's commit marker) grows with
    the retained steps, never the hosts."""
    _assert_scaling(measured)
    for hosts, rows in measured.items():
        assert rows["lease_renewal"].by_op == {"list": 1, "read": 1, "write": 1}, "a renewal: list, read, rewrite"
        assert rows["lease_check"].by_op == {"list": 1, "read": 1}, "the check before a save: list, read"
        listing = rows["listing"]
        assert not (listing.per_caller > 4 + 3 * STEPS), f"{hosts} hosts: {listing.per_caller:g} requests per listing"


def test_on_gcs_no_piece_grows_per_host_and_the_primary_pieces_are_constant(gcs_env):
    from benchmarks import scale_protocol
    from tests import helpers

    url = gcs_env["STORAGE_EMULATOR_HOST"]
    measured = _simulate(helpers.gs_workdir("scale"), lambda threads: scale_protocol.GcsRequests(url))
    _assert_object_store_requests(measured)
    for hosts, rows in measured.items():
        assert rows["listing"].by_op["list"] >= hosts, "every process lists the checkpoints once"


def test_on_s3_no_piece_grows_per_host_and_the_lease_takes_the_same_requests_as_on_gcs(s3_env):
    from benchmarks import scale_protocol
    from tests import helpers

    url = s3_env["AWS_ENDPOINT_URL"]
    measured = _simulate(helpers.s3_workdir("scale"), lambda threads: scale_protocol.S3Requests(url))
    _assert_object_store_requests(measured)


def test_on_a_local_disk_each_process_lists_once_and_reads_one_manifest(tmp_path):
    from benchmarks import scale_protocol

    measured = _simulate(str(tmp_path / "run"), scale_protocol.AuditedCalls)
    _assert_scaling(measured)
    for hosts, rows in measured.items():
        assert rows["listing"].by_op == {"os.listdir": hosts}, "one directory listing per process"
        assert rows["manifest_read"].by_op == {"open": hosts}, "one open of the manifest per process"
