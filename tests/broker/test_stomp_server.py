"""The STOMP 1.2 server of a live node, over the wire: security, errors, semantics, reattach."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker import SHARED_NODE_LEASE
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One live node without a backup (degraded), shared by this module's tests."""
    with BrokerPair(
        tmp_path_factory.mktemp("stomp") / "pair", start_backup=False, lease=SHARED_NODE_LEASE
    ) as pair:
        yield pair.live


def client(node: NodeProcess) -> WireClient:
    c = WireClient(node.stomp_port)
    assert c.connect().command == "CONNECTED"
    return c


def unique(name: str) -> str:
    return f"/queue/{name}-{time.monotonic_ns()}"


# --- security ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("login", "passcode"), [("admin", "wrong"), ("nobody", "admin"), (None, None)]
)
def test_bad_credentials_are_refused(
    node: NodeProcess, login: str | None, passcode: str | None
) -> None:
    c = WireClient(node.stomp_port)
    headers = {"accept-version": "1.2", "host": "localhost"}
    if login is not None and passcode is not None:
        headers.update(login=login, passcode=passcode)
    c.send("CONNECT", headers)
    frame = c.receive()
    assert frame.command == "ERROR"
    assert "authentication failed" in (frame.get("message") or "")
    assert c.closed()


@pytest.mark.parametrize(
    ("accept", "version"),
    [("1.0,1.1", "1.1"), ("1.1,1.2", "1.2"), ("1.0", "1.0"), (None, "1.0"), ("1.2,2.0", "1.2")],
)
def test_the_highest_common_version_is_spoken(
    node: NodeProcess, accept: str | None, version: str
) -> None:
    c = WireClient(node.stomp_port)
    headers = {"login": "admin", "passcode": "admin"}
    if accept is not None:
        headers["accept-version"] = accept
    c.send("CONNECT", headers)
    frame = c.receive()
    assert frame.command == "CONNECTED"
    assert frame.get("version") == version
    assert (frame.get("heart-beat") is None) == (version == "1.0")  # 1.0 has none


def test_no_version_in_common_is_refused_naming_those_spoken(node: NodeProcess) -> None:
    c = WireClient(node.stomp_port)
    c.send("CONNECT", {"accept-version": "2.0,3.1", "login": "admin", "passcode": "admin"})
    frame = c.receive()
    assert frame.command == "ERROR"
    assert frame.get("version") == "1.0,1.1,1.2"
    assert "2.0,3.1" in (frame.get("message") or "")
    assert c.closed()


# --- malformed input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"HELLO\n\n\x00",
        b"SEND\ndestination:/queue/x\ncontent-length:2\n\nabc\x00",
        b"SEND\ndestination:/queue/x\nbad\\tescape:1\n\nabc\x00",
        b"SEND\n" + b"h:" + b"x" * 70000 + b"\n\n\x00",
        b"\xff\xfe\x00\x01garbage" * 8 + b"\n",
        b"SEND\nno-colon-here\n\n\x00",
    ],
)
def test_malformed_frames_get_an_error_and_the_broker_keeps_serving(
    node: NodeProcess, garbage: bytes
) -> None:
    bad = client(node)
    bad.send_raw(garbage)
    frame = bad.receive()
    assert frame.command == "ERROR"
    assert frame.get("message")
    assert bad.closed()
    # Another client is unaffected and nothing it sent is lost.
    good = client(node)
    destination = unique("after-garbage")
    good.send("SEND", {"destination": destination, "persistent": "true", "receipt": "r"}, b"ok")
    assert good.receive().command == "RECEIPT"
    good.send("SUBSCRIBE", {"id": "s", "destination": destination})
    message = good.receive()
    assert message.command == "MESSAGE"
    assert message.body == b"ok"


def test_first_frame_must_be_connect(node: NodeProcess) -> None:
    c = WireClient(node.stomp_port)
    c.send("SEND", {"destination": "/queue/x"}, b"too early")
    frame = c.receive()
    assert frame.command == "ERROR"
    assert "CONNECT" in (frame.get("message") or "")


def test_unknown_destination_and_missing_headers_name_the_problem(node: NodeProcess) -> None:
    c = client(node)
    c.send("SEND", {"destination": "nowhere", "receipt": "r1"}, b"x")
    frame = c.receive()
    assert frame.command == "ERROR"
    assert "unknown destination 'nowhere'" in (frame.get("message") or "")
    assert frame.get("receipt-id") == "r1"
    c = client(node)
    c.send("SUBSCRIBE", {"destination": "/queue/x"})
    assert "needs id and destination" in (c.receive().get("message") or "")


# --- messaging semantics -----------------------------------------------------------------


def test_binary_bodies_and_headers_round_trip(node: NodeProcess) -> None:
    c = client(node)
    destination = unique("binary")
    body = bytes(range(256)) * 4
    c.send(
        "SEND",
        {"destination": destination, "colour": "blue:green\nred", "receipt": "r"},
        body,
    )
    assert c.receive().command == "RECEIPT"
    c.send("SUBSCRIBE", {"id": "s", "destination": destination})
    message = c.receive()
    assert message.body == body
    assert message.get("colour") == "blue:green\nred"
    assert message.get("destination") == destination
    assert message.get("subscription") == "s"


def test_competing_consumers_share_a_queue(node: NodeProcess) -> None:
    destination = unique("compete")
    a, b = client(node), client(node)
    for c, sub in ((a, "a"), (b, "b")):
        c.send("SUBSCRIBE", {"id": sub, "destination": destination, "receipt": sub})
        assert c.receive().command == "RECEIPT"
    producer = client(node)
    for i in range(10):
        producer.send("SEND", {"destination": destination}, str(i).encode())
    producer.send("DISCONNECT", {"receipt": "bye"})
    assert producer.receive().command == "RECEIPT"
    received = [a.receive().body for _ in range(5)] + [b.receive().body for _ in range(5)]
    assert sorted(received, key=int) == [str(i).encode() for i in range(10)]


def test_topic_fans_out_to_every_subscriber(node: NodeProcess) -> None:
    topic = f"/topic/prices-{time.monotonic_ns()}"
    subscribers = [client(node) for _ in range(2)]
    for i, c in enumerate(subscribers):
        c.send("SUBSCRIBE", {"id": str(i), "destination": topic, "receipt": "s"})
        assert c.receive().command == "RECEIPT"
    client(node).send("SEND", {"destination": topic}, b"42")
    for c in subscribers:
        assert c.receive().body == b"42"


def test_transaction_commit_and_abort(node: NodeProcess) -> None:
    destination = unique("tx")
    c = client(node)
    c.send("BEGIN", {"transaction": "t1"})
    c.send("SEND", {"destination": destination, "transaction": "t1", "persistent": "true"}, b"kept")
    c.send("BEGIN", {"transaction": "t2"})
    c.send("SEND", {"destination": destination, "transaction": "t2"}, b"dropped")
    c.send("ABORT", {"transaction": "t2"})
    c.send("COMMIT", {"transaction": "t1", "receipt": "c"})
    assert c.receive().command == "RECEIPT"
    c.send("SUBSCRIBE", {"id": "s", "destination": destination})
    assert c.receive().body == b"kept"
    with pytest.raises(TimeoutError):
        c.receive(timeout=0.5)


def test_commit_of_an_unknown_transaction_is_an_error(node: NodeProcess) -> None:
    c = client(node)
    c.send("COMMIT", {"transaction": "never-begun"})
    frame = c.receive()
    assert frame.command == "ERROR"
    assert "never-begun" in (frame.get("message") or "")


def test_nack_redelivers_with_redelivered_flag_and_count(node: NodeProcess) -> None:
    destination = unique("nack")
    c = client(node)
    c.send("SEND", {"destination": destination}, b"again")
    c.send("SUBSCRIBE", {"id": "s", "destination": destination, "ack": "client-individual"})
    first = c.receive()
    assert first.get("redelivered") == "false"
    c.send("NACK", {"id": first.get("ack") or ""})
    second = c.receive()
    assert second.body == b"again"
    assert second.get("redelivered") == "true"
    assert second.get("hafailover-delivery-count") == "1"
    c.send("ACK", {"id": second.get("ack") or "", "receipt": "done"})
    assert c.receive().command == "RECEIPT"


def test_dead_letter_after_max_deliveries(node: NodeProcess) -> None:
    destination = unique("poison")
    c = client(node)
    c.send("SEND", {"destination": destination, "persistent": "true"}, b"poison")
    c.send("SUBSCRIBE", {"id": "s", "destination": destination, "ack": "client-individual"})
    for _ in range(10):
        frame = c.receive()
        c.send("NACK", {"id": frame.get("ack") or ""})
    with pytest.raises(TimeoutError):
        c.receive(timeout=0.5)
    dlq = client(node)
    dlq.send("SUBSCRIBE", {"id": "d", "destination": "/queue/DLQ"})
    bodies = []
    while True:
        try:
            bodies.append(dlq.receive(timeout=1).body)
        except TimeoutError:
            break
    assert b"poison" in bodies


def test_temporary_queue_request_reply(node: NodeProcess) -> None:
    server, requester = client(node), client(node)
    service = unique("service")
    server.send("SUBSCRIBE", {"id": "svc", "destination": service, "receipt": "r"})
    assert server.receive().command == "RECEIPT"
    requester.send("SUBSCRIBE", {"id": "replies", "destination": "/temp-queue/replies"})
    requester.send("SEND", {"destination": service, "reply-to": "/temp-queue/replies"}, b"ping")
    request = server.receive()
    # The broker rewrote the session-scoped name into the queue's broker-wide address, so
    # that a reply from another session reaches the requester's queue.
    reply_to = request.get("reply-to") or ""
    assert reply_to.startswith("temp-queue://")
    server.send("SEND", {"destination": reply_to}, b"pong")
    assert requester.receive().body == b"pong"


def test_duplicate_id_sends_are_dropped_but_confirmed(node: NodeProcess) -> None:
    destination = unique("dups")
    c = client(node)
    for attempt in range(3):
        c.send(
            "SEND",
            {
                "destination": destination,
                "persistent": "true",
                "_AMQ_DUPL_ID": "order-1",
                "receipt": f"r{attempt}",
            },
            b"once",
        )
        assert c.receive().command == "RECEIPT"
    c.send("SUBSCRIBE", {"id": "s", "destination": destination})
    delivered = c.receive()
    assert delivered.body == b"once"
    # Delivered with the message, as on Artemis: the id that is the same on every node.
    assert delivered.get("_AMQ_DUPL_ID") == "order-1"
    with pytest.raises(TimeoutError):
        c.receive(timeout=0.5)


def test_heart_beats_are_sent_and_silence_is_detected(node: NodeProcess) -> None:
    c = WireClient(node.stomp_port)
    frame = c.connect(heart_beat="100,100")
    assert frame.get("heart-beat")
    # The server sends EOLs; a client that goes silent is closed after about twice the period.
    c.sock.settimeout(0.6)
    assert c.sock.recv(10).startswith(b"\n")
    assert c.closed(timeout=5)


# --- reattach extension (docs/protocol-reattach.md) --------------------------------------


def test_reattach_resumes_the_session_and_names_the_last_command(node: NodeProcess) -> None:
    destination = unique("reattach")
    c = WireClient(node.stomp_port)
    connected = c.connect(hafailover_window="1000000", hafailover_ttl="10000")
    session = connected.get("hafailover-session")
    assert session
    assert connected.get("hafailover-topology")
    c.send("SUBSCRIBE", {"id": "s", "destination": destination, "ack": "client-individual"})
    for i in range(5):
        c.send("SEND", {"destination": destination}, str(i).encode())
    delivered = [c.receive().body for _ in range(5)]
    assert delivered == [str(i).encode() for i in range(5)]
    # The socket dies without DISCONNECT: the broker keeps the session.
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    again = WireClient(node.stomp_port)
    resumed = again.connect(hafailover_reattach=session)
    assert resumed.get("hafailover-last-received") == "5"  # SUBSCRIBE and 5 SENDs: ids 0-5
    # Deliveries that were never acknowledged are sent again on the new socket.
    redelivered = [again.receive() for _ in range(5)]
    assert [f.body for f in redelivered] == delivered
    assert all(f.get("redelivered") == "true" for f in redelivered)
    for frame in redelivered:
        again.send("ACK", {"id": frame.get("ack") or ""})
    again.send("DISCONNECT", {"receipt": "bye"})
    assert again.receive().command == "RECEIPT"


def test_reattach_to_an_unknown_session_is_refused_and_starts_fresh(node: NodeProcess) -> None:
    c = WireClient(node.stomp_port)
    frame = c.connect(hafailover_reattach="no-such-session")
    assert frame.command == "CONNECTED"
    assert frame.get("hafailover-reattach") == "refused"
    assert frame.get("hafailover-session") != "no-such-session"


def test_confirmations_arrive_every_half_window(node: NodeProcess) -> None:
    c = WireClient(node.stomp_port)
    c.connect(hafailover_window="2000", hafailover_ttl="5000")
    destination = unique("confirm")
    for _ in range(20):
        c.send("SEND", {"destination": destination}, b"x" * 100)
    confirmations = []
    while True:
        try:
            frame = c.receive(timeout=0.5)
        except TimeoutError:
            break
        receipt = frame.get("receipt-id") or ""
        if receipt.startswith("hafailover-confirm:"):
            confirmations.append(int(receipt.split(":")[1]))
    assert confirmations
    assert confirmations == sorted(confirmations)
    assert confirmations[-1] <= 19


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.binary(min_size=1, max_size=2000))
def test_arbitrary_bytes_never_hurt_the_broker(node: NodeProcess, garbage: bytes) -> None:
    """Whatever a connected client sends, the broker answers with an ERROR, a close or
    silence, and another client's persistent message stays safe."""
    destination = unique("fuzz")
    keeper = client(node)
    keeper.send("SEND", {"destination": destination, "persistent": "true", "receipt": "k"}, b"kept")
    assert keeper.receive().command == "RECEIPT"
    fuzzer = client(node)
    try:
        fuzzer.send_raw(garbage)
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            frame = fuzzer.receive(timeout=0.2)
            assert frame.command in ("ERROR", "RECEIPT", "MESSAGE")
    finally:
        fuzzer.close()
    keeper.send("SUBSCRIBE", {"id": "s", "destination": destination})
    assert keeper.receive().body == b"kept"
    keeper.close()
