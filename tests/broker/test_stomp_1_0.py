"""STOMP 1.0 as its specification has it, on a live node: by raw frames and by stomp.py.

1.0 differs from 1.1 and 1.2 where a 1.0 client relies on it: SUBSCRIBE's ``id`` is optional
(the destination then names the subscription), UNSUBSCRIBE may name the subscription by
``destination`` alone, and every frame may carry a body, which the receiver ignores.
1.1 and 1.2 keep their rules, checked here alongside.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import stomp

from hafailover.protocols.stomp.frame import (
    Frame,
    FrameParser,
    Side,
    StompProtocolError,
)
from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker import SHARED_NODE_LEASE
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with BrokerPair(
        tmp_path_factory.mktemp("stomp10") / "pair", start_backup=False, lease=SHARED_NODE_LEASE
    ) as pair:
        yield pair.live


def queue(name: str) -> str:
    return f"/queue/{name}-{uuid.uuid4().hex[:8]}"


def raw(command: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    """A frame as a 1.0 client writes it: no escaping, and a body on any command."""
    lines = [command, *(f"{k}:{v}" for k, v in headers.items())]
    return ("\n".join(lines) + "\n\n").encode() + body + b"\x00"


def connect_1_0(node: NodeProcess, body: bytes = b"") -> WireClient:
    c = WireClient(node.stomp_port)
    c.parser.version = "1.0"
    c.send_raw(raw("CONNECT", {"login": "admin", "passcode": "admin"}, body))
    connected = c.receive()
    assert connected.command == "CONNECTED", connected
    assert connected.get("version") == "1.0"
    return c


# --- the codec -----------------------------------------------------------------------------


@pytest.mark.parametrize("accept", [None, "1.0"])
def test_the_codec_takes_a_body_on_a_connect_that_negotiates_1_0(accept: str | None) -> None:
    parser = FrameParser(Side.SERVER)
    headers = {"login": "a"} | ({"accept-version": accept} if accept else {})
    [frame] = parser.feed(raw("CONNECT", headers, b"ignored"))
    assert isinstance(frame, Frame)
    assert frame.command == "CONNECT"
    assert frame.body == b"ignored"


@pytest.mark.parametrize("accept", ["1.1", "1.0,1.2"])
def test_the_codec_refuses_a_body_on_a_1_1_or_1_2_connect(accept: str) -> None:
    parser = FrameParser(Side.SERVER)
    with pytest.raises(StompProtocolError, match="CONNECT frame must not have a body"):
        parser.feed(raw("CONNECT", {"accept-version": accept}, b"x"))


def test_the_codec_takes_a_body_on_any_1_0_frame_and_not_on_1_2() -> None:
    old = FrameParser(Side.SERVER, version="1.0")
    [frame] = old.feed(raw("SUBSCRIBE", {"destination": "/queue/a", "content-length": "3"}, b"abc"))
    assert isinstance(frame, Frame)
    assert frame.body == b"abc"
    new = FrameParser(Side.SERVER, version="1.2")
    with pytest.raises(StompProtocolError, match="SUBSCRIBE frame must not have a body"):
        new.feed(raw("SUBSCRIBE", {"destination": "/queue/a", "id": "1"}, b"abc"))


# --- raw frames against the node -------------------------------------------------------------


def test_a_1_0_client_subscribes_without_id_and_unsubscribes_by_destination(
    node: NodeProcess,
) -> None:
    c = connect_1_0(node, body=b"a CONNECT body, ignored")
    try:
        destination = queue("noid")
        c.send_raw(raw("SUBSCRIBE", {"destination": destination, "receipt": "s"}, b"ignored"))
        assert c.receive().get("receipt-id") == "s"
        c.send_raw(raw("SEND", {"destination": destination}, b"one"))
        message = c.receive()
        assert message.command == "MESSAGE"
        assert message.body == b"one"
        assert message.get("destination") == destination
        c.send_raw(raw("UNSUBSCRIBE", {"destination": destination, "receipt": "u"}, b"x"))
        assert c.receive().get("receipt-id") == "u"
        c.send_raw(raw("SEND", {"destination": destination, "receipt": "after"}, b"two"))
        # Unsubscribed: the receipt comes and no MESSAGE with it.
        assert c.receive().get("receipt-id") == "after"
        with pytest.raises(TimeoutError):
            c.receive(timeout=0.5)
    finally:
        c.close()


def test_a_1_0_unsubscribe_by_destination_finds_a_subscription_made_with_an_id(
    node: NodeProcess,
) -> None:
    c = connect_1_0(node)
    try:
        destination = queue("withid")
        c.send_raw(raw("SUBSCRIBE", {"destination": destination, "id": "sub-7"}))
        c.send_raw(raw("UNSUBSCRIBE", {"destination": destination, "receipt": "u"}))
        assert c.receive().get("receipt-id") == "u"
        # The id is free again: subscribing with it is accepted.
        c.send_raw(raw("SUBSCRIBE", {"destination": destination, "id": "sub-7", "receipt": "s"}))
        assert c.receive().get("receipt-id") == "s"
    finally:
        c.close()


def test_a_1_0_unsubscribe_naming_nothing_subscribed_is_a_clear_error(node: NodeProcess) -> None:
    c = connect_1_0(node)
    try:
        c.send_raw(raw("UNSUBSCRIBE", {"destination": "/queue/never-subscribed"}))
        error = c.receive()
        assert error.command == "ERROR"
        assert "no subscription to '/queue/never-subscribed'" in (error.get("message") or "")
    finally:
        c.close()


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_1_1_and_1_2_keep_their_rules(node: NodeProcess, version: str) -> None:
    c = WireClient(node.stomp_port)
    try:
        assert c.connect(accept_version=version).command == "CONNECTED"
        c.send("SUBSCRIBE", {"destination": queue("strict")})
        error = c.receive()
        assert error.command == "ERROR"
        assert "SUBSCRIBE needs id and destination headers" in (error.get("message") or "")
    finally:
        c.close()
    c = WireClient(node.stomp_port)
    try:
        c.send_raw(raw("CONNECT", {"accept-version": version, "login": "admin"}, b"body"))
        error = c.receive()
        assert error.command == "ERROR"
        assert "CONNECT frame must not have a body" in (error.get("message") or "")
    finally:
        c.close()


# --- stomp.py's Connection10 -----------------------------------------------------------------


class Counter(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.errors: list[Any] = []
        self.done = threading.Event()
        self.expected = 0

    def on_message(self, frame: Any) -> None:
        self.bodies.append(frame.body)
        if len(self.bodies) >= self.expected:
            self.done.set()

    def on_error(self, frame: Any) -> None:
        self.errors.append(frame.headers)
        self.done.set()


def test_a_1_0_publisher_delivers_10000_messages_to_a_1_0_subscriber(node: NodeProcess) -> None:
    count = 10_000
    destination = queue("ten-thousand")
    subscriber = stomp.Connection10([("127.0.0.1", node.stomp_port)], auto_decode=False)
    heard = Counter()
    heard.expected = count
    subscriber.set_listener("s", heard)
    subscriber.connect("admin", "admin", wait=True)
    publisher = stomp.Connection10([("127.0.0.1", node.stomp_port)], auto_decode=False)
    publisher.connect("admin", "admin", wait=True)
    try:
        subscriber.subscribe(destination)  # no id: 1.0 names it by its destination
        for n in range(count):
            publisher.send(destination, str(n).encode())
        assert heard.done.wait(90), f"{len(heard.bodies)} of {count} delivered"
        assert heard.errors == []
        assert sorted(int(b) for b in heard.bodies) == list(range(count))
        subscriber.unsubscribe(destination=destination)
        time.sleep(0.2)
        assert heard.errors == []
    finally:
        publisher.disconnect()
        subscriber.disconnect()
