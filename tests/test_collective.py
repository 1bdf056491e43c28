"""Agreements on a real 3-process pod (127.0.0.1, the JAX distributed runtime): process 0's answer
reaches every process through the runtime's key-value store, process 0 waits until every process has
read it, and the store keeps at most one batch of keys."""

import pytest

from tests import helpers


@pytest.mark.slow
def test_every_process_gets_process_0s_answer_through_the_store():
    results = helpers.pod_results("tests.collective_child", num_processes=3, devices_per_process=1)
    for result in results.values():
        assert result["ints"] == [1, 2]
        assert result["rows"] == [[0, 0], [0, 1], [0, 2]]
        assert result["no_rows"] == []
        assert result["decided"] is True
        assert result["late"] == 42
        assert result["many"] == list(range(2 * 64))
    # Process 0 returned from the late agreement only once process 1, a second late, had read it.
    assert results[0]["returned_at"] >= results[1]["sleep_started"] + 1.0
    # Keys are removed by batch once read: what is left is the last batch's, at most one batch of them.
    left = results[0]["keys_left"]
    assert 0 < len(left) <= 64, left
    assert len({key.rsplit("/", 1)[0] for key in left}) == 1, left
