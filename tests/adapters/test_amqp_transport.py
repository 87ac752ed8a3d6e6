"""The AMQP 1.0 adapter against the reference broker, over real sockets.

Messages are converted without a broker in the first tests; the rest run a live-only
reference broker (a real process) and, for the losses, one of their own to kill or pause.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import proton
import pytest
from hypothesis import given
from hypothesis import strategies as st
from proton import Link, Terminus
from proton.reactor import ApplicationEvent, Container, EventInjector

from hafailover.destination import Destination, DestinationKind
from hafailover.errors import (
    ConfigurationError,
    IllegalStateError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    SecurityError,
    UnblockedError,
)
from hafailover.message import Message, PropertyValue
from hafailover.protocols.amqp import transport as amqp_transport
from hafailover.protocols.amqp.codec import decode_message, encode_message
from hafailover.protocols.amqp.engine import Outcome
from hafailover.protocols.amqp.transport import AmqpTransport
from hafailover.protocols.base import TlsOptions
from hafailover.url import BrokerAddress
from reference_broker.pair import BrokerPair, NodeProcess

pytestmark = [pytest.mark.timeout(60)]


class Recorder:
    """The events of one transport, with a wait for what a test expects."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, int, Message]] = []
        self.settled: dict[int, RemoteError | None] = {}
        self.errors: list[ProtocolError] = []
        self.lost: list[str] = []
        self.changed = threading.Condition()

    def _note(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def on_message(self, subscription: str, delivery: int, message: Message) -> None:
        self.messages.append((subscription, delivery, message))
        self._note()

    def on_settled(self, token: int, error: RemoteError | None) -> None:
        self.settled[token] = error
        self._note()

    def on_error(self, error: ProtocolError) -> None:
        self.errors.append(error)
        self._note()

    def on_lost(self, reason: str) -> None:
        self.lost.append(reason)
        self._note()

    def wait(self, predicate: Callable[[], object], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                assert remaining > 0, "timed out"
                self.changed.wait(remaining)

    def bodies(self, subscription: str | None = None) -> list[bytes | str]:
        return [m.body for s, _, m in self.messages if subscription in (None, s)]


def reactor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hafailover-amqp")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fresh_queue() -> Destination:
    return Destination.queue(f"amqp-adapter-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path_factory.mktemp("amqp") / "pair", start_backup=False) as started:
        yield started


def address(node: NodeProcess, password: str = "admin") -> BrokerAddress:
    return BrokerAddress("amqp", "127.0.0.1", node.amqp_port, "admin", password)


@pytest.fixture
def connect(pair: BrokerPair) -> Iterator[Callable[..., tuple[AmqpTransport, Recorder]]]:
    """Open transports on the shared live; whatever a test leaves open is aborted."""
    made: list[AmqpTransport] = []

    def make(**options: float) -> tuple[AmqpTransport, Recorder]:
        events = Recorder()
        transport = AmqpTransport(events, **options)
        transport.open(address(pair.live))
        made.append(transport)
        return transport, events

    yield make
    for transport in made:
        transport.abort()


# --- conversion, without a broker -------------------------------------------------------------

text = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\n\r")
property_values = st.one_of(
    st.text(alphabet=text, max_size=20),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
)
property_names = st.text(alphabet=text, min_size=1, max_size=20).filter(
    lambda name: name != "_AMQ_DUPL_ID"
)


@given(
    body=st.one_of(st.binary(max_size=64), st.text(alphabet=text, max_size=64)),
    properties=st.dictionaries(property_names, property_values, max_size=5),
    persistent=st.booleans(),
    priority=st.integers(0, 9),
    correlation_id=st.none() | st.text(alphabet=text, min_size=1, max_size=20),
)
def test_a_message_survives_encoding(
    body: bytes | str,
    properties: dict[str, PropertyValue],
    persistent: bool,
    priority: int,
    correlation_id: str | None,
) -> None:
    message = Message(
        body,
        properties=properties,
        persistent=persistent,
        priority=priority,
        correlation_id=correlation_id,
        reply_to="queue://replies",
        time_to_live=30,
    )
    payload = encode_message(
        message, "queue://orders", reply_to="queue://replies", duplicate_detection=True
    )
    received = decode_message(payload)
    assert received.body == body
    assert type(received.body) is type(body)
    assert received.properties == properties
    assert received.persistent is persistent
    assert received.priority == priority
    assert received.correlation_id == correlation_id
    assert received.message_id == message.message_id
    assert received.reply_to == Destination.queue("replies")
    assert received.destination == Destination.queue("orders")
    assert received.time_to_live == 30


def test_text_that_utf8_cannot_carry_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="cannot be encoded"):
        AmqpTransport(Recorder()).send(
            1, Destination.queue("q"), Message("\ud800"), duplicate_detection=False
        )


def test_the_duplicate_id_goes_on_persistent_sends_only() -> None:
    def application_properties(message: Message, *, duplicate_detection: bool) -> object:
        decoded = proton.Message()
        decoded.decode(
            encode_message(message, "q", reply_to=None, duplicate_detection=duplicate_detection)
        )
        return decoded.properties or {}

    persistent = Message(b"x", persistent=True)
    stamped = application_properties(persistent, duplicate_detection=True)
    assert stamped == {"_AMQ_DUPL_ID": persistent.message_id}
    assert application_properties(persistent, duplicate_detection=False) == {}
    assert application_properties(Message(b"x", persistent=False), duplicate_detection=True) == {}
    # the message id is given once and kept: a resend carries the same duplicate id
    first = persistent.message_id
    application_properties(persistent, duplicate_detection=True)
    assert persistent.message_id == first


# --- against the reference broker -------------------------------------------------------------


@pytest.mark.broker
def test_pipelined_sends_are_settled_and_received_intact(
    pair: BrokerPair, connect: Callable[..., tuple[AmqpTransport, Recorder]]
) -> None:
    transport, events = connect()
    queue = fresh_queue()
    sent = [
        Message(
            f"m{i}".encode(),
            properties={"seq": i, "kind": "test", "flag": i % 2 == 0},
            correlation_id=f"c-{i}",
            reply_to="queue://replies",
            priority=4,
        )
        for i in range(1000)
    ]
    for i, message in enumerate(sent):
        size = transport.send(i, queue, message, duplicate_detection=True)
        assert size > len(message.body_bytes)
    events.wait(lambda: len(events.settled) == 1000)
    assert set(events.settled) == set(range(1000))
    assert all(error is None for error in events.settled.values())

    transport.subscribe("s1", queue, credit=100, settle_on_delivery=False)
    events.wait(lambda: len(events.messages) == 1000)
    for (subscription, delivery, received), original in zip(events.messages, sent, strict=True):
        assert subscription == "s1"
        assert received.body == original.body
        assert received.message_id == original.message_id
        assert received.correlation_id == original.correlation_id
        assert received.reply_to == Destination.queue("replies")
        assert received.destination == queue
        assert received.persistent is True
        assert not received.redelivered
        # the reference broker keeps property values as text (it shares them with STOMP)
        assert received.properties["seq"] == str(original.properties["seq"])
        assert received.properties["kind"] == "test"
        assert "_AMQ_DUPL_ID" not in received.properties
        transport.settle(delivery, Outcome.ACCEPTED)
    assert len({delivery for _, delivery, _ in events.messages}) == 1000
    transport.unsubscribe("s1")

    # accepted means gone: a new subscriber finds the queue empty
    again = Recorder()
    check = AmqpTransport(again)
    check.open(address(pair.live))
    check.subscribe("s2", queue, credit=10, settle_on_delivery=True)
    check.send(1, queue, Message(b"marker"), duplicate_detection=False)
    again.wait(lambda: again.messages)
    assert again.bodies() == [b"marker"]
    check.close()
    transport.close()
    assert not events.lost
    assert not events.errors


@pytest.mark.broker
def test_released_and_modified_messages_come_back_marked(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    queue = fresh_queue()
    transport.send(1, queue, Message("again"), duplicate_detection=True)
    transport.subscribe("s", queue, credit=1, settle_on_delivery=False)
    events.wait(lambda: len(events.messages) == 1)
    _, first, message = events.messages[0]
    assert not message.redelivered
    transport.settle(first, Outcome.RELEASED)
    events.wait(lambda: len(events.messages) == 2)
    _, second, redelivered = events.messages[1]
    assert redelivered.body == "again"
    assert redelivered.redelivered
    assert redelivered.delivery_count == 0  # released: not a failed attempt
    transport.settle(second, Outcome.MODIFIED)
    events.wait(lambda: len(events.messages) == 3)
    _, third, failed_once = events.messages[2]
    assert failed_once.redelivered
    assert failed_once.delivery_count == 1
    assert failed_once.message_id == message.message_id
    transport.settle(third, Outcome.ACCEPTED)
    transport.settle(third, Outcome.ACCEPTED)  # settled already: ignored
    transport.close()
    assert not events.errors


@pytest.mark.broker
def test_a_rejected_send_reports_the_outcome_and_the_reason(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    nowhere = Destination(DestinationKind.TEMPORARY_QUEUE, "never-created")
    transport.send(7, nowhere, Message(b"lost"), duplicate_detection=True)
    events.wait(lambda: 7 in events.settled)
    error = events.settled[7]
    assert isinstance(error, ProtocolError)
    assert "rejected" in str(error)
    assert "amqp:not-found" in str(error)
    # the connection goes on
    queue = fresh_queue()
    transport.send(8, queue, Message(b"fine"), duplicate_detection=True)
    events.wait(lambda: 8 in events.settled)
    assert events.settled[8] is None
    transport.close()


@pytest.mark.broker
def test_a_refused_subscription_raises_and_the_connection_goes_on(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    nowhere = Destination(DestinationKind.TEMPORARY_QUEUE, "never-created")
    with pytest.raises(ProtocolError, match="amqp:not-found"):
        transport.subscribe("gone", nowhere, credit=5, settle_on_delivery=False)
    queue = fresh_queue()
    transport.subscribe("gone", queue, credit=5, settle_on_delivery=True)  # the id is free again
    transport.send(1, queue, Message(b"ok"), duplicate_detection=False)
    events.wait(lambda: events.messages)
    with pytest.raises(IllegalStateError, match="exists already"):
        transport.subscribe("gone", queue, credit=5, settle_on_delivery=True)
    transport.close()
    assert not events.lost


@pytest.mark.broker
def test_a_wrong_password_is_a_security_error(pair: BrokerPair) -> None:
    with pytest.raises(SecurityError, match="refused the login"):
        AmqpTransport(Recorder()).open(address(pair.live, password="wrong"))
    assert not reactor_threads()


def test_nobody_listening_is_not_connected() -> None:
    with pytest.raises(NotConnectedError, match="refused"):
        AmqpTransport(Recorder(), connect_timeout=2).open(BrokerAddress("amqp", "127.0.0.1", 9))
    assert not reactor_threads()


@pytest.mark.broker
def test_a_transaction_shows_its_sends_only_on_commit(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    queue = fresh_queue()
    transport.subscribe("watch", queue, credit=10, settle_on_delivery=False)

    tx = transport.declare()
    for i in range(3):
        transport.send(i, queue, Message(f"commit-{i}"), duplicate_detection=True, tx=tx)
    events.wait(lambda: len(events.settled) == 3)
    assert all(error is None for error in events.settled.values())
    time.sleep(0.3)
    assert not events.messages  # not before the commit
    transport.discharge(tx, fail=False)
    events.wait(lambda: len(events.messages) == 3)
    assert events.bodies() == ["commit-0", "commit-1", "commit-2"]

    rolled_back = transport.declare()
    assert rolled_back != tx
    transport.send(10, queue, Message("rolled back"), duplicate_detection=True, tx=rolled_back)
    events.wait(lambda: 10 in events.settled)
    transport.discharge(rolled_back, fail=True)
    # acknowledgements join a transaction too: rolled back, the messages come again
    consume = transport.declare()
    for _, delivery, _ in list(events.messages):
        transport.settle(delivery, Outcome.ACCEPTED, tx=consume)
    transport.discharge(consume, fail=True)
    events.wait(lambda: len(events.messages) == 6)
    assert events.bodies()[3:] == ["commit-0", "commit-1", "commit-2"]
    assert all(m.redelivered for _, _, m in events.messages[3:])
    commit = transport.declare()
    for _, delivery, _ in events.messages[3:]:
        transport.settle(delivery, Outcome.ACCEPTED, tx=commit)
    transport.discharge(commit, fail=False)
    time.sleep(0.3)
    assert "rolled back" not in events.bodies()
    assert len(events.messages) == 6

    with pytest.raises(ProtocolError, match="refused the discharge"):
        transport.discharge(commit, fail=False)  # discharged already: unknown to the broker
    other = AmqpTransport(Recorder())
    with pytest.raises(IllegalStateError, match="another connection"):
        other.send(1, queue, Message(b"x"), duplicate_detection=True, tx=commit)
    transport.close()
    assert not events.lost


@pytest.mark.broker
def test_a_temporary_queue_round_trip(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    temporary = transport.create_temporary_queue()
    assert temporary.kind is DestinationKind.TEMPORARY_QUEUE
    transport.subscribe("replies", temporary, credit=5, settle_on_delivery=True)
    request = Message(b"ping", reply_to=temporary, persistent=False)
    queue = fresh_queue()
    transport.send(1, queue, request, duplicate_detection=True)
    transport.subscribe("requests", queue, credit=5, settle_on_delivery=True)
    events.wait(lambda: events.bodies("requests"))
    received = events.messages[0][2]
    assert received.reply_to == temporary
    transport.send(2, received.reply_to, Message(b"pong"), duplicate_detection=True)
    events.wait(lambda: events.bodies("replies"))
    assert events.bodies("replies") == [b"pong"]
    # Its consumer first (JMS deletes no temporary queue that has one): the broker reads
    # the frames in order, so no consumer is left for the deletion to end.
    transport.unsubscribe("replies")
    transport.delete_temporary_queue(temporary)
    assert not events.errors
    # One that still has a consumer: the broker ends it, and that is reported.
    other = transport.create_temporary_queue()
    transport.subscribe("orphan", other, credit=5, settle_on_delivery=True)
    transport.delete_temporary_queue(other)
    events.wait(lambda: events.errors)
    [error] = events.errors
    assert type(error) is ProtocolError
    assert "subscription 'orphan'" in str(error) and "amqp:resource-deleted" in str(error)
    transport.close()


@pytest.mark.broker
def test_unsubscribe_gives_unsettled_messages_back(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    queue = fresh_queue()
    for i in range(3):
        transport.send(i, queue, Message(f"u{i}"), duplicate_detection=True)
    transport.subscribe("first", queue, credit=10, settle_on_delivery=False)
    events.wait(lambda: len(events.messages) == 3)
    transport.unsubscribe("first")
    transport.subscribe("second", queue, credit=10, settle_on_delivery=False)
    events.wait(lambda: len(events.bodies("second")) == 3)
    assert sorted(events.bodies("second"), key=str) == ["u0", "u1", "u2"]
    transport.close()


@pytest.mark.broker
def test_a_durable_subscription_keeps_what_is_published_while_away(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    topic = Destination.topic(f"amqp-adapter-{uuid.uuid4().hex[:12]}")
    name = f"durable-{uuid.uuid4().hex[:8]}"
    transport.subscribe("d1", topic, credit=5, settle_on_delivery=False, durable_name=name)
    transport.unsubscribe("d1")  # a detach: the subscription stays on the broker
    transport.send(1, topic, Message(b"while away"), duplicate_detection=True)
    events.wait(lambda: 1 in events.settled)
    transport.subscribe("d2", topic, credit=5, settle_on_delivery=False, durable_name=name)
    events.wait(lambda: events.messages)
    _, delivery, message = events.messages[0]
    assert message.body == b"while away"
    assert message.destination == topic
    transport.settle(delivery, Outcome.ACCEPTED)
    transport.unsubscribe("d2", remove_durable=True)  # a close: the subscription goes
    transport.send(2, topic, Message(b"nobody listens"), duplicate_detection=True)
    events.wait(lambda: 2 in events.settled)
    transport.subscribe("d3", topic, credit=5, settle_on_delivery=False, durable_name=name)
    time.sleep(0.3)
    assert len(events.messages) == 1
    transport.close()
    assert not events.errors


@pytest.mark.broker
def test_events_run_on_the_reactor_which_refuses_blocking_calls(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    queue = fresh_queue()
    refused: list[BaseException] = []

    def blocking_in_callback(subscription: str, delivery: int, message: Message) -> None:
        try:
            transport.declare(timeout=1)
        except IllegalStateError as exc:
            refused.append(exc)
        transport.settle(delivery, Outcome.ACCEPTED)  # not blocking: allowed
        raise RuntimeError("a broken callback is logged, not fatal")

    events.on_message = blocking_in_callback  # type: ignore[method-assign]
    transport.subscribe("s", queue, credit=5, settle_on_delivery=False)
    transport.send(1, queue, Message(b"a"), duplicate_detection=True)
    transport.send(2, queue, Message(b"b"), duplicate_detection=True)
    events.wait(lambda: len(refused) == 2)
    assert "would never end" in str(refused[0])
    transport.send(3, queue, Message(b"c"), duplicate_detection=True)
    events.wait(lambda: 3 in events.settled)  # the reactor lives on
    transport.close()
    assert not events.lost


@pytest.mark.broker
def test_close_and_abort_leave_no_thread_or_socket_behind(
    pair: BrokerPair, connect: Callable[..., tuple[AmqpTransport, Recorder]]
) -> None:
    fds = open_fds()
    for ending in ("close", "abort"):
        transport, events = connect()
        queue = fresh_queue()
        transport.subscribe("s", queue, credit=5, settle_on_delivery=False)
        for i in range(100):
            transport.send(i, queue, Message(b"x"), duplicate_detection=True)
        started = time.monotonic()
        getattr(transport, ending)()
        assert time.monotonic() - started < 3
        assert not reactor_threads(), ending
        assert not events.lost, ending
        with pytest.raises(NotConnectedError):
            transport.send(1, queue, Message(b"late"), duplicate_detection=True)
        transport.close()  # twice: nothing happens
    assert open_fds() <= fds


@pytest.mark.broker
def test_losing_the_broker_is_reported_once(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as own:
        events = Recorder()
        transport = AmqpTransport(events, heartbeat=0.25)
        transport.open(address(own.live))
        queue = fresh_queue()
        transport.subscribe("s", queue, credit=5, settle_on_delivery=False)
        blocked: list[BaseException] = []
        own.pause(own.live)  # a declare now waits for an answer that will never come
        waiter = threading.Thread(target=lambda: _declare_into(transport, blocked))
        waiter.start()
        time.sleep(0.1)
        started = time.monotonic()
        own.kill(own.live)
        events.wait(lambda: events.lost, timeout=5)
        assert time.monotonic() - started < 2
        waiter.join(5)
        assert len(blocked) == 1
        assert "lost" in str(blocked[0])
        time.sleep(0.5)
        assert len(events.lost) == 1
        with pytest.raises(NotConnectedError):
            transport.send(1, queue, Message(b"late"), duplicate_detection=True)
        for thread in reactor_threads():
            thread.join(2)
        assert not reactor_threads()
        transport.close()


def _declare_into(transport: AmqpTransport, errors: list[BaseException]) -> None:
    try:
        transport.declare(timeout=10)
    except RemoteError as exc:
        errors.append(exc)


@pytest.mark.broker
def test_a_silent_broker_is_detected_by_the_heartbeat(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", start_backup=False) as own:
        events = Recorder()
        transport = AmqpTransport(events, heartbeat=0.25)
        transport.open(address(own.live))
        time.sleep(0.5)  # heart-beats flow: nothing is lost while the broker lives
        assert not events.lost
        own.pause(own.live)
        try:
            started = time.monotonic()
            events.wait(lambda: events.lost, timeout=5)
            assert time.monotonic() - started < 1.5
            assert "idle" in events.lost[0]
        finally:
            own.resume(own.live)
        time.sleep(0.3)
        assert len(events.lost) == 1
        transport.close()
        assert not reactor_threads()


# The stalls below outlast the client's idle timeout (twice its heart-beat, 0.3 s) and stay
# well within the broker's (1 s: the pair's 0.5 s heart-beat twice): the client writes only
# when its reader runs, so the broker hears nothing for up to a heart-beat of its own
# (0.25 s), plus a frame's wait (about 0.08 s), plus the stall: about 0.73 s.
STALLED_HEARTBEAT = 0.15
STALL = 0.4


class _StalledPoller:
    """``select.poll()`` for the reader, whose timed waits are taken as having found
    nothing (the broker's frame, if any, came just after: its readiness is dropped), and
    whose thread then gets a processor only ``stall`` seconds later (a loaded machine),
    ``times`` times. The broker's frames arrive meanwhile and stay in the socket to be read
    (readiness is a level)."""

    def __init__(self, stall: float, times: int) -> None:
        self._poller = select.poll()
        self.stall = stall
        self.left = times

    def register(self, fd: Any, mask: int) -> None:
        self._poller.register(fd, mask)

    def modify(self, fd: Any, mask: int) -> None:
        self._poller.modify(fd, mask)

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        ready = self._poller.poll(timeout)
        if timeout and self.left > 0:
            self.left -= 1
            time.sleep(self.stall)
            return []
        return ready


@pytest.mark.broker
def test_a_reader_late_after_its_deadline_reads_before_judging_the_broker_silent(
    connect: Callable[..., tuple[AmqpTransport, Recorder]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heart-beats the broker sent while the reader waited for a processor past its
    idle timeout are there to read: they count, and the broker is not declared dead."""
    pollers: list[_StalledPoller] = []

    def stalled() -> _StalledPoller:
        pollers.append(_StalledPoller(stall=STALL, times=3))
        return pollers[-1]

    monkeypatch.setattr(
        amqp_transport,
        "select",
        SimpleNamespace(poll=stalled, POLLIN=select.POLLIN, POLLOUT=select.POLLOUT),
    )
    transport, events = connect(heartbeat=STALLED_HEARTBEAT)
    deadline = time.monotonic() + 10
    while pollers[0].left and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pollers[0].left == 0, "the reader never waited until a deadline"
    time.sleep(0.3)
    assert events.lost == []
    queue = fresh_queue()
    transport.send(1, queue, Message(b"after"), duplicate_detection=True)
    events.wait(lambda: 1 in events.settled)
    assert events.settled[1] is None
    transport.close()


class _SlowFirstMessage(Recorder):
    """Events whose first message takes ``delay`` seconds to handle, on the reader's thread."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def on_message(self, subscription: str, delivery: int, message: Message) -> None:
        if not self.messages:
            time.sleep(self.delay)
        super().on_message(subscription, delivery, message)


@pytest.mark.broker
def test_a_reader_back_from_a_slow_event_reads_before_judging_the_broker_silent(
    pair: BrokerPair,
) -> None:
    """An event handled past the idle timeout (a slow callback on the reader's thread): the
    heart-beats the broker sent meanwhile are read before proton keeps time."""
    events = _SlowFirstMessage(delay=STALL)
    transport = AmqpTransport(events, heartbeat=STALLED_HEARTBEAT)
    transport.open(address(pair.live))
    try:
        queue = fresh_queue()
        transport.send(1, queue, Message(b"slow"), duplicate_detection=True)
        transport.subscribe("s", queue, credit=5, settle_on_delivery=True)
        events.wait(lambda: events.messages)
        time.sleep(0.3)
        assert events.lost == []
        transport.send(2, queue, Message(b"after"), duplicate_detection=True)
        events.wait(lambda: 2 in events.settled)
        assert events.settled[2] is None
        assert events.lost == []
    finally:
        transport.abort()


@pytest.mark.broker
def test_sends_from_many_threads_are_all_settled(
    connect: Callable[..., tuple[AmqpTransport, Recorder]],
) -> None:
    transport, events = connect()
    queue = fresh_queue()

    def producer(first: int) -> None:
        for token in range(first, first + 250):
            transport.send(token, queue, Message(str(token)), duplicate_detection=True)

    threads = [threading.Thread(target=producer, args=(n * 1000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events.wait(lambda: len(events.settled) == 1000)
    assert all(error is None for error in events.settled.values())
    transport.subscribe("s", queue, credit=50, settle_on_delivery=True)
    events.wait(lambda: len(events.messages) == 1000)
    assert sorted(int(body) for body in events.bodies()) == sorted(events.settled)
    transport.close()


def test_a_peer_that_never_answers_times_out() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # the kernel accepts; nobody ever speaks
        started = time.monotonic()
        with pytest.raises(NotConnectedError, match="did not open within"):
            AmqpTransport(Recorder(), connect_timeout=0.5).open(
                BrokerAddress("amqp", "127.0.0.1", silent.getsockname()[1], "admin", "admin")
            )
        assert time.monotonic() - started < 2
    assert not reactor_threads()


# --- against a scripted peer: what the reference broker never does ------------------------------


class ScriptedPeer(proton.Handler):
    """A minimal AMQP 1.0 peer on its own reactor thread.

    It announces ``product`` in its Open, records the client's terminus of every attach
    (address, durability, expiry policy), answers each attach by echoing it, except that it
    never answers one whose address contains "held" and refuses one whose address contains
    "refused" by ending the session with ``refusal`` (how RabbitMQ refuses an attach to a
    queue of another durability). Transfers are accepted.
    """

    def __init__(self, *, product: str | None = None, refusal: str | None = None) -> None:
        super().__init__()
        self.product = product
        self.refusal = refusal
        self.attaches: list[tuple[str, int, int]] = []
        self.transfers: list[bool] = []  # whether each transfer came settled
        self.sender_modes: list[int] = []  # the settle mode of each sender the client attached
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self.container = Container(self)
        self.injector = EventInjector()
        self.container.selectable(self.injector)
        self.container.listen(f"127.0.0.1:{self.port}")
        self.thread = threading.Thread(target=self.container.run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress("amqp", "127.0.0.1", self.port, None, None)

    def terminus(self, address: str) -> tuple[int, int]:
        """Durability and expiry policy of the first attach to ``address``."""
        return next((d, e) for a, d, e in self.attaches if a == address)

    def on_connection_remote_open(self, event: proton.Event) -> None:
        connection = event.connection
        assert connection is not None
        if self.product is not None:
            connection.properties = {proton.symbol("product"): self.product}
        connection.open()

    def on_session_remote_open(self, event: proton.Event) -> None:
        assert event.session is not None
        event.session.open()

    def on_link_remote_open(self, event: proton.Event) -> None:
        link = event.link
        assert link is not None
        terminus = link.remote_target if link.is_receiver else link.remote_source
        address = terminus.address or ""
        self.attaches.append((address, terminus.durability, terminus.expiry_policy))
        if link.is_receiver:
            self.sender_modes.append(link.remote_snd_settle_mode)
        if "refused" in address:
            name = address.rsplit("/", 1)[-1]
            link.session.condition = proton.Condition(
                "amqp:precondition-failed",
                self.refusal
                or f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue '{name}'",
            )
            link.session.close()
        elif "held" not in address:
            link.target.copy(link.remote_target)
            link.source.copy(link.remote_source)
            link.open()
            if link.is_receiver:
                link.flow(100)

    def on_connection_remote_close(self, event: proton.Event) -> None:
        assert event.connection is not None
        event.connection.close()

    def on_session_remote_close(self, event: proton.Event) -> None:
        assert event.session is not None
        event.session.close()

    def on_link_remote_close(self, event: proton.Event) -> None:
        assert event.link is not None
        event.link.close()

    def on_delivery(self, event: proton.Event) -> None:
        delivery = event.delivery
        assert delivery is not None
        link = delivery.link
        if link.is_receiver and not delivery.partial:
            self.transfers.append(delivery.settled)
            link.recv(delivery.pending)
            link.advance()
            delivery.update(proton.Delivery.ACCEPTED)
            delivery.settle()

    def on_scripted_peer_stop(self, event: proton.Event) -> None:
        self.container.stop()

    def close(self) -> None:
        self.injector.trigger(ApplicationEvent("scripted_peer_stop"))
        self.thread.join(5)
        for fd in self.injector.pipe:
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedPeer]]:
    made: list[ScriptedPeer] = []

    def make(**options: str) -> ScriptedPeer:
        peer = ScriptedPeer(**options)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


def test_queues_on_rabbitmq_are_asked_durable_by_senders_and_receivers(
    scripted: Callable[..., ScriptedPeer],
) -> None:
    # RabbitMQ declares a /queue/x as durable as the terminus naming it: without this a
    # restart deletes the queue and the confirmed messages in it. Senders and receivers ask
    # alike, since RabbitMQ refuses an attach of another durability than the queue's.
    peer = scripted(product="RabbitMQ")
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(peer.address)
    transport.send(1, Destination.queue("orders"), Message(b"x"), duplicate_detection=False)
    transport.send(2, Destination.topic("prices"), Message(b"x"), duplicate_detection=False)
    transport.subscribe("q", Destination.queue("orders"), credit=5, settle_on_delivery=False)
    transport.subscribe("t", Destination.topic("prices"), credit=5, settle_on_delivery=True)
    events.wait(lambda: len(events.settled) == 2)
    durable = (Terminus.DELIVERIES, Terminus.EXPIRE_NEVER)
    assert [a for a, _, _ in peer.attaches].count("/queue/orders") == 2
    assert all((d, e) == durable for a, d, e in peer.attaches if a == "/queue/orders")
    # a topic is not a queue: its termini stay as they were
    assert all(d == Terminus.NONDURABLE for a, d, _ in peer.attaches if a == "/topic/prices")
    transport.close()
    assert not events.lost
    assert not events.errors


def test_queues_elsewhere_keep_the_default_terminus(
    scripted: Callable[..., ScriptedPeer],
) -> None:
    peer = scripted()  # no product: the canonical dialect, as with the reference broker
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(peer.address)
    transport.send(1, Destination.queue("orders"), Message(b"x"), duplicate_detection=False)
    transport.subscribe("q", Destination.queue("orders"), credit=5, settle_on_delivery=False)
    events.wait(lambda: 1 in events.settled)
    assert [a for a, _, _ in peer.attaches] == ["queue://orders", "queue://orders"]
    assert all(d == Terminus.NONDURABLE for _, d, _ in peer.attaches)
    transport.close()


@pytest.mark.parametrize("product", ["RabbitMQ", None])
def test_sends_nobody_waits_for_go_settled_on_rabbitmq_only(
    scripted: Callable[..., ScriptedPeer], product: str | None
) -> None:
    # No token: nobody waits for the send. On RabbitMQ it goes pre-settled (as a 0-9-1
    # publish without confirms: no disposition per message); a confirmed one stays
    # unsettled everywhere, and elsewhere so does every send (the reference broker's credit
    # follows its confirmations).
    peer = scripted(product=product)
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(peer.address)
    queue = Destination.queue("orders")
    transport.send(None, queue, Message(b"a"), duplicate_detection=False)
    transport.send(1, queue, Message(b"b"), duplicate_detection=False)
    transport.send(None, queue, Message(b"c"), duplicate_detection=False)
    events.wait(lambda: 1 in events.settled and len(peer.transfers) == 3)
    assert peer.transfers == ([True, False, True] if product else [False, False, False])
    # the link says so too: mixed on RabbitMQ (each transfer chooses), unsettled elsewhere
    assert peer.sender_modes == [Link.SND_MIXED if product else Link.SND_UNSETTLED]
    assert events.settled[1] is None
    transport.close()
    assert not events.lost
    assert not events.errors


def test_a_refusal_that_ends_the_session_goes_to_the_refused_send(
    scripted: Callable[..., ScriptedPeer],
) -> None:
    # RabbitMQ refuses an attach by ending the session. The send was never transferred (no
    # credit before the attach): it is settled with the refusal, not left in doubt by the
    # loss that follows; a request the broker had not refused is released as by a loss.
    peer = scripted(product="RabbitMQ")
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(peer.address)
    held: list[BaseException] = []

    def subscribe_held() -> None:
        try:
            transport.subscribe("h", Destination.queue("held"), credit=1, settle_on_delivery=True)
        except RemoteError as exc:
            held.append(exc)

    waiting = threading.Thread(target=subscribe_held)
    waiting.start()
    deadline = time.monotonic() + 5
    while not peer.attaches:  # until the held attach is on the broker
        assert time.monotonic() < deadline, "the subscribe never attached"
        time.sleep(0.01)
    transport.send(5, Destination.queue("refused-1"), Message(b"x"), duplicate_detection=False)
    events.wait(lambda: 5 in events.settled and events.lost)
    error = events.settled[5]
    assert type(error) is ProtocolError
    assert "amqp:precondition-failed" in str(error)
    assert "inequivalent arg 'durable'" in str(error)
    assert "not sent" in str(error)
    waiting.join(5)
    assert len(held) == 1
    assert type(held[0]) is UnblockedError, held  # not refused: lost with the connection
    assert len(events.lost) == 1
    transport.close()
    assert not reactor_threads()


@pytest.mark.parametrize(
    "refusal", [None, "a reason that names no queue"], ids=["named", "unnamed"]
)
def test_a_refusal_that_ends_the_session_fails_the_refused_subscribe(
    scripted: Callable[..., ScriptedPeer], refusal: str | None
) -> None:
    peer = scripted(product="RabbitMQ", refusal=refusal)
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(peer.address)
    with pytest.raises(ProtocolError, match="amqp:precondition-failed") as raised:
        transport.subscribe("s", Destination.queue("refused-2"), credit=1, settle_on_delivery=False)
    assert type(raised.value) is ProtocolError
    events.wait(lambda: events.lost)
    transport.close()


# --- amqps, through a TLS-terminating proxy in front of the broker ------------------------------


class TlsProxy:
    """Accepts TLS on loopback and forwards the plain bytes to the broker."""

    def __init__(self, certificate: Path, key: Path, upstream: int) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certificate, key)
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
                secure = self.context.wrap_socket(client, server_side=True)
            except OSError:
                continue
            broker = socket.create_connection(("127.0.0.1", self.upstream))
            for source, sink in ((secure, broker), (broker, secure)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    where = tmp_path_factory.mktemp("tls")
    certificate, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(certificate)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return certificate, key


@pytest.mark.broker
def test_amqps_verifies_the_broker_and_logs_in_over_tls(
    pair: BrokerPair, certificate: tuple[Path, Path]
) -> None:
    proxy = TlsProxy(*certificate, upstream=pair.live.amqp_port)
    try:
        broker = BrokerAddress("amqps", "localhost", proxy.port, "admin", "admin")
        # A certificate nobody vouched for: a TLS refusal, which no retry can mend.
        with pytest.raises(SecurityError, match="certificate verify failed"):
            AmqpTransport(Recorder()).open(broker)
        events = Recorder()
        transport = AmqpTransport(events, tls=TlsOptions(ca_file=str(certificate[0])))
        opened = transport.open(broker)
        assert opened.topology
        queue = fresh_queue()
        transport.send(1, queue, Message(b"secret"), duplicate_detection=True)
        transport.subscribe("s", queue, credit=1, settle_on_delivery=True)
        events.wait(lambda: events.messages and 1 in events.settled)
        assert events.settled[1] is None
        assert events.bodies() == [b"secret"]
        transport.close()
        with pytest.raises(SecurityError):
            AmqpTransport(Recorder(), tls=TlsOptions(ca_file=str(certificate[0]))).open(
                BrokerAddress("amqps", "localhost", proxy.port, "admin", "wrong")
            )
    finally:
        proxy.close()
    assert not reactor_threads()
