"""Connection caps (--max-connections, --max-connections-per-user): one over is refused with
the cap named, on STOMP (ERROR) and AMQP (close with amqp:resource-limit-exceeded); the
connections already in are unaffected, and a closed one frees its place. --max-connections
counts every accepted socket, logged in or not."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proton import ConnectionException

from reference_broker.users import UsersFile, login_guard
from tests.broker.stomp_wire import WireClient
from tests.broker.test_amqp_server import InProcessBroker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

AT_MOST_3 = "too many connections: this node serves at most 3 (--max-connections)"


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[InProcessBroker]:
    users = UsersFile()
    users.add("admin", "admin")
    users.add("bob", "bob-secret")
    broker = InProcessBroker(
        tmp_path, users, heartbeat=5.0, max_connections=3, max_connections_per_user=2
    )
    yield broker
    broker.close()


def stomp_client(broker: InProcessBroker, user: str, password: str) -> tuple[WireClient, str]:
    c = WireClient(broker.stomp_port)
    frame = c.connect(user, password)
    return c, frame.command if frame.command != "ERROR" else f"ERROR {frame.get('message')}"


def round_trip(c: WireClient) -> None:
    destination = f"/queue/cap-{uuid.uuid4().hex[:8]}"
    c.send("SUBSCRIBE", {"id": "s", "destination": destination})
    c.send("SEND", {"destination": destination}, b"in")
    assert c.receive(10).body == b"in"


def test_caps_in_all_and_per_user_refuse_clearly_and_spare_the_others(
    capped: InProcessBroker,
) -> None:
    first, answer = stomp_client(capped, "admin", "admin")
    assert answer == "CONNECTED"
    second, answer = stomp_client(capped, "admin", "admin")
    assert answer == "CONNECTED"

    third, answer = stomp_client(capped, "admin", "admin")
    assert answer == (
        "ERROR too many connections for user 'admin': at most 2 each (--max-connections-per-user)"
    )
    assert third.closed()
    with pytest.raises(ConnectionException, match="amqp:resource-limit-exceeded") as raised:
        capped.connect().close()
    assert "for user 'admin': at most 2" in str(raised.value)

    bob, answer = stomp_client(capped, "bob", "bob-secret")
    assert answer == "CONNECTED"  # another user: 3 in all
    again, answer = stomp_client(capped, "bob", "bob-secret")
    assert answer == "ERROR too many connections: this node serves at most 3 (--max-connections)"
    with pytest.raises(ConnectionException, match="amqp:resource-limit-exceeded"):
        capped.connect(user="bob", password="bob-secret").close()

    # Those in are unaffected.
    for c in (first, second, bob):
        round_trip(c)

    # A closed connection frees its place, for either protocol.
    first.close()
    deadline = time.monotonic() + 10
    while capped.call(lambda: capped.core.connections) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    amqp = capped.connect()
    amqp.close()
    fourth, answer = stomp_client(capped, "admin", "admin")
    assert answer == "CONNECTED"
    for c in (second, bob, fourth, third, again):
        c.close()


def test_the_caps_count_nothing_for_a_failed_login(capped: InProcessBroker) -> None:
    for _ in range(5):
        c, answer = stomp_client(capped, "admin", "wrong")
        assert answer.startswith("ERROR")
        c.close()
    ok = [stomp_client(capped, "admin", "admin") for _ in range(2)]
    assert [answer for _, answer in ok] == ["CONNECTED", "CONNECTED"]
    for c, _ in ok:
        c.close()


def test_sockets_that_never_log_in_count_against_the_cap(capped: InProcessBroker) -> None:
    """A flood of sockets that never log in fills --max-connections and no more: one over is
    refused at once with the cap named, on either protocol, without a password check; a
    closed one frees its place."""
    flood = [socket.create_connection(("127.0.0.1", port)) for port in (capped.port,) * 3]
    try:
        wait_for(lambda: capped.call(lambda: capped.core.connections) == 3, "the flood counted")
        late, answer = stomp_client(capped, "admin", "admin")
        assert (
            answer == "ERROR too many connections: this node serves at most 3 (--max-connections)"
        )
        assert late.closed()
        with pytest.raises(ConnectionException, match="amqp:resource-limit-exceeded") as raised:
            capped.connect().close()
        assert "at most 3 (--max-connections)" in str(raised.value)
        # More sockets over the cap are closed, and are not counted.
        extra = socket.create_connection(("127.0.0.1", capped.stomp_port))
        with extra:
            extra.settimeout(10)
            assert b"too many connections" in extra.recv(4096)
            assert extra.recv(4096) == b""
        assert capped.call(lambda: capped.core.connections) == 3
        assert capped.call(lambda: capped.core.refused_connections) == 3
        assert login_derivations(capped) == 0
    finally:
        flood.pop().close()
    wait_for(lambda: capped.call(lambda: capped.core.connections) == 2, "a place freed")
    c, answer = stomp_client(capped, "admin", "admin")
    assert answer == "CONNECTED"
    c.close()
    for s in flood:
        s.close()


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def login_derivations(broker: InProcessBroker) -> int:
    return broker.call(lambda: login_guard(broker.users).derivations)
