"""The STOMP adapter against the reference broker and RabbitMQ, over real sockets."""

from __future__ import annotations

import enum
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafailover.errors import NotConnectedError, ProtocolError, SecurityError
from hafailover.message import Message
from hafailover.protocols.stomp.transport import StompTransport, send_headers
from hafailover.url import BrokerAddress
from reference_broker.pair import BrokerPair, NodeProcess

pytestmark = [pytest.mark.timeout(60)]


class Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[str, str, Message]] = []
        self.receipts: list[str] = []
        self.confirmed: list[int] = []
        self.errors: list[ProtocolError] = []
        self.lost: list[str] = []
        self.changed = threading.Condition()

    def _note(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def on_message(self, subscription: str, ack_id: str, message: Message) -> None:
        self.messages.append((subscription, ack_id, message))
        self._note()

    def on_receipt(self, receipt_id: str) -> None:
        self.receipts.append(receipt_id)
        self._note()

    def on_confirmed(self, upto: int) -> None:
        self.confirmed.append(upto)
        self._note()

    def on_error(self, error: ProtocolError) -> None:
        self.errors.append(error)
        self._note()

    def on_lost(self, reason: str) -> None:
        self.lost.append(reason)
        self._note()

    def wait(self, predicate: object, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():  # type: ignore[operator]
                remaining = deadline - time.monotonic()
                assert remaining > 0, "timed out"
                self.changed.wait(remaining)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path_factory.mktemp("adapter") / "pair", start_backup=False) as started:
        yield started


def address(node: NodeProcess, password: str = "admin") -> BrokerAddress:
    return BrokerAddress("stomp", "127.0.0.1", node.stomp_port, "admin", password)


@pytest.mark.broker
def test_open_send_subscribe_receive(pair: BrokerPair) -> None:
    events = Recorder()
    transport = StompTransport(events)
    opened = transport.open(address(pair.live), window=100_000, connection_ttl=10)
    assert opened.session_id
    assert not opened.resumed
    assert opened.topology[0] == ("127.0.0.1", pair.live.stomp_port)
    message = Message("hello", properties={"seq": 1, "flag": True}, correlation_id="c-1")
    headers = send_headers(message, duplicate_detection=True)
    assert headers["_AMQ_DUPL_ID"] == message.message_id
    transport.write("SEND", {"destination": "/queue/adapter", "receipt": "r1", **headers}, b"hello")
    events.wait(lambda: "r1" in events.receipts)
    transport.write(
        "SUBSCRIBE", {"id": "s1", "destination": "/queue/adapter", "ack": "client-individual"}
    )
    events.wait(lambda: events.messages)
    subscription, ack_id, received = events.messages[0]
    assert subscription == "s1"
    assert ack_id
    assert received.body == b"hello"
    assert received.properties["seq"] == "1"
    assert received.properties["flag"] == "true"
    assert received.correlation_id == "c-1"
    assert received.persistent is True
    assert str(received.destination) == "queue://adapter"
    transport.write("ACK", {"id": ack_id})
    transport.close()
    assert not events.lost


@pytest.mark.broker
def test_small_frames_go_out_at_once_and_in_one_write(pair: BrokerPair) -> None:
    """Nagle's algorithm is off: a frame written while an earlier one is unacknowledged
    (a receipt sync after receipt-less sends, a COMMIT after its SENDs) waited for the
    broker's delayed TCP acknowledgement, about 40 ms a call. Frames written together go
    in one write."""
    events = Recorder()
    transport = StompTransport(events)
    transport.open(address(pair.live))
    sock = transport._connection.transport.socket  # type: ignore[union-attr]
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    sizes = transport.write_frames(
        [
            ("BEGIN", {"transaction": "t1"}, b""),
            ("ABORT", {"transaction": "t1", "receipt": "r-sync"}, b""),
        ]
    )
    assert len(sizes) == 2 and all(size > 0 for size in sizes)
    events.wait(lambda: "r-sync" in events.receipts)
    transport.close()


@pytest.mark.broker
def test_a_wrong_password_is_a_security_error(pair: BrokerPair) -> None:
    with pytest.raises(SecurityError, match="refused the login"):
        StompTransport(Recorder()).open(address(pair.live, password="wrong"))


def test_nobody_listening_is_not_connected(tmp_path: Path) -> None:
    with pytest.raises(NotConnectedError):
        StompTransport(Recorder(), connect_timeout=1).open(BrokerAddress("stomp", "127.0.0.1", 9))


@pytest.mark.broker
def test_an_error_frame_is_reported(pair: BrokerPair) -> None:
    events = Recorder()
    transport = StompTransport(events)
    transport.open(address(pair.live))
    transport.write("COMMIT", {"transaction": "never-begun"})
    events.wait(lambda: events.errors)
    assert "never-begun" in str(events.errors[0])
    transport.abort()


@pytest.mark.broker
def test_reattach_to_a_held_session(pair: BrokerPair) -> None:
    first = Recorder()
    transport = StompTransport(first)
    opened = transport.open(address(pair.live), window=4096, connection_ttl=10)
    for i in range(3):
        transport.write("SEND", {"destination": "/queue/reattach-adapter"}, str(i).encode())
    time.sleep(0.3)
    transport.abort()  # no DISCONNECT: the broker keeps the session
    again = StompTransport(Recorder())
    resumed = again.open(address(pair.live), reattach=opened.session_id)
    assert resumed.resumed
    assert resumed.last_received == 2
    again.close()
    fresh = StompTransport(Recorder()).open(address(pair.live), reattach="gone")
    assert fresh.reattach_refused
    assert not fresh.resumed


@pytest.mark.broker
def test_losing_the_broker_is_reported_once(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as own:
        events = Recorder()
        transport = StompTransport(events, heartbeat=0.25)
        transport.open(address(own.live))
        own.kill(own.live)
        events.wait(lambda: events.lost, timeout=5)
        time.sleep(0.5)
        assert len(events.lost) == 1


class _Shade(str, enum.Enum):  # noqa: UP042 - users write it; str() is "_Shade.DARK"
    DARK = "dark"


class _Level(enum.IntEnum):
    HIGH = 300


def test_an_enum_property_is_sent_as_its_value() -> None:
    message = Message("x", properties={"shade": _Shade.DARK, "level": _Level.HIGH, "on": True})
    headers = send_headers(message, duplicate_detection=False)
    assert (headers["shade"], headers["level"], headers["on"]) == ("dark", "300", "true")


def test_frames_escape_headers_and_always_carry_a_content_length() -> None:
    from hafailover.protocols.stomp.transport import encode_frame

    frame = encode_frame("SEND", {"destination": "/queue/a", "odd:key": "line\nbreak\\"}, b"a\x00b")
    assert frame == (
        b"SEND\ndestination:/queue/a\nodd\\ckey:line\\nbreak\\\\\ncontent-length:3\n\na\x00b\x00"
    )
    assert encode_frame("ACK", {"id": "7"}) == b"ACK\nid:7\n\n\x00"
