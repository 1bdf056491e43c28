"""The local pod's launcher copies each process's stdout and stderr whole line by line: an error line
never lands inside a line the runtime's C++ was still writing."""

import io
import signal

import pytest

from launch import pod as pod_lib


@pytest.mark.slow
def test_a_stderr_line_written_inside_a_stdout_line_stays_a_line_of_its_own():
    output = io.StringIO()
    pod, pumps = pod_lib.start_pod("tests.pod_output_child", [], num_processes=1, devices_per_process=1,
                                   output=output)
    try:
        assert pod.processes[0].wait(timeout=60) == 0
    finally:
        pod.signal_all(signal.SIGKILL)  # any still running
    for pump in pumps:
        pump.join(timeout=10)
    assert sorted(output.getvalue().splitlines()) == [
        "[0] [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        "[0] error: the refusal, one line"]
