"""The save marks' fingerprints on a real 2 x 2 pod (127.0.0.1, gloo): leaves replicated over the processes
are hashed half by each process, and the partial lanes meet in one all-reduce; the values are each leaf's
fingerprint computed whole (checkpointing/_src/marks.py)."""

import pytest

from tests import helpers


@pytest.mark.slow
def test_a_pods_fingerprints_split_over_processes_equal_each_leafs_whole_in_one_all_reduce():
    results = helpers.pod_results("tests.marks_pod_child", num_processes=2, devices_per_process=2)
    for result in results.values():
        assert sorted(result["got"]) == sorted(result["whole"]) and len(result["got"]) == 7, result
        assert result["got"] == result["whole"], result
        assert result["all_reduces"] + result["all_reduce_starts"] == 1, result
        # Each device hashes half of what a split within its process alone leaves it (the 64 x 32 leaf dominates).
        assert result["flops"] <= 0.6 * result["flops_within_processes"], result
    assert results[0]["got"] == results[1]["got"]
