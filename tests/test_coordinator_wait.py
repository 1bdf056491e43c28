"""A peer knocks on the coordinator's port before the runtime's gRPC client dials it (whose first
retry, after a refused connection, comes a second later)."""

import socket
import threading

import pytest

from runtime import distributed


def test_a_peer_waits_until_the_coordinator_listens_and_no_longer():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused, as before process 0 starts
    address = f"127.0.0.1:{server.getsockname()[1]}"
    waiter = threading.Thread(target=distributed.await_coordinator, args=(address,), daemon=True)
    try:
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive(), "returned while nothing listened"
        server.listen()
        waiter.join(10)
        assert not waiter.is_alive(), "still waiting after the coordinator listened"
    finally:
        server.close()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:port", "host:"])
def test_an_address_without_a_port_is_refused_in_one_line(address):
    with pytest.raises(ValueError, match=rf"^--coordinator_address={address} must be host:port$"):
        distributed.await_coordinator(address)
