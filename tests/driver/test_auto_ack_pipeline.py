"""F6 with pipelined AUTO acknowledges, against the scripted broker: the next message is
handed out before the previous acknowledge is confirmed only when a redelivery of the
previous one can be told by its sender's id; after a reconnect that lost such acknowledges,
the application sees at most the last message it had again. Milliseconds, no real broker."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hafailover
from hafailover import AckMode, AcknowledgeFailedError, Message
from hafailover.ack_modes import auto as auto_rules

from .fake import FAST_URL, FakeBroker, link_factory

pytestmark = pytest.mark.timeout(60)

URL = FAST_URL


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker(duplicate_detection=False)
    started.start()
    yield started
    started.stop()


def put(broker: FakeBroker, count: int, *, ids: bool = True, first: int = 0) -> None:
    with broker.lock:
        broker.queues["orders"].extend(
            Message(str(n), message_id=f"m{n}" if ids else None) for n in range(first, count)
        )


def buffered(consumer: hafailover.Consumer, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(consumer._buffer) < count:
        assert time.monotonic() < deadline, "nothing was delivered"
        time.sleep(0.002)


def test_a_message_with_its_senders_id_does_not_wait_for_the_previous_acknowledge(
    broker: FakeBroker,
) -> None:
    with auto_consumer(broker, 3) as (_connection, consumer):
        with broker.paused():  # nothing is read: no acknowledge is confirmed
            got = [consumer.receive(1) for _ in range(3)]
            assert [m.text for m in got if m is not None] == ["0", "1", "2"]
        deadline = time.monotonic() + 5
        while any(s.unacked for s in broker.sessions.values()):
            assert time.monotonic() < deadline, "the acknowledges never arrived"
            time.sleep(0.002)


@pytest.mark.parametrize("why", ["no sender id", "block_on_acknowledge"])
def test_otherwise_the_next_message_waits_for_the_previous_acknowledge(
    broker: FakeBroker, why: str
) -> None:
    url = URL + ("&block_on_acknowledge=true" if why == "block_on_acknowledge" else "")
    with auto_consumer(broker, 2, ids=why != "no sender id", url=url) as (_connection, consumer):
        with broker.paused():
            first = consumer.receive(1)
            assert first is not None and first.text == "0"
            assert consumer.receive(0.2) is None  # unconfirmed: F6 holds it back
        second = consumer.receive(5)
        assert second is not None and second.text == "1"


def test_at_most_pipelined_acks_wait_at_once(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auto_rules, "PIPELINED_ACKS", 3)
    with auto_consumer(broker, 6) as (_connection, consumer):
        with broker.paused():
            # The last one's acknowledge and three before it: the fifth must wait.
            got = [consumer.receive(1) for _ in range(4)]
            assert [m.text for m in got if m is not None] == ["0", "1", "2", "3"]
            assert consumer.receive(0.2) is None
        fifth = consumer.receive(5)
        assert fifth is not None and fifth.text == "4"


def test_a_reconnect_gives_the_application_at_most_the_last_message_again(
    broker: FakeBroker,
) -> None:
    """The broker read none of five pipelined acknowledges; the new session gets all five
    again. Only the last one handed out is delivered (after receive() says so), the four
    before it are acknowledged and dropped."""
    with auto_consumer(broker, 5) as (_connection, consumer):
        with broker.paused():
            got = [consumer.receive(1) for _ in range(5)]
            assert all(m is not None for m in got)
            lose(broker, "fresh")
        with pytest.raises(AcknowledgeFailedError):
            consumer.receive(5)
        again = consumer.receive(5)
        assert again is not None and again.text == "4"
        assert consumer.receive(0.3) is None
        assert consumer.duplicates_dropped == 4
        assert broker.violations == []
        with broker.lock:
            assert not broker.queues["orders"]
            assert all(not s.unacked for s in broker.sessions.values())


@pytest.mark.parametrize("read", [0, 2, 5])
def test_a_reattach_replays_the_pipelined_acknowledges(broker: FakeBroker, read: int) -> None:
    """The server read ``read`` of five acknowledges before the loss and sends the rest of
    the five messages again as the session is reattached (the bundled broker does): the
    replayed acknowledges settle them, and none is handed out again or acknowledged twice."""
    with auto_consumer(broker, 5) as (connection, consumer):
        with broker.paused():
            got = [consumer.receive(1) for _ in range(5)]
            assert all(m is not None for m in got)
            link = broker.current()
            link.deliver(read)
            for thread in link.lose(noticed_by=("reader",)):
                thread.join(5)
        assert consumer.receive(0.3) is None  # nothing comes again, nothing raises
        assert connection.statistics().reattached == 1
        assert broker.violations == []
        with broker.lock:
            assert all(not s.unacked for s in broker.sessions.values())


def test_a_listener_is_not_given_a_message_whose_pipelined_acknowledge_was_lost(
    broker: FakeBroker,
) -> None:
    heard: list[hafailover.HaFailoverError] = []
    got: list[str] = []
    done = threading.Event()
    with hafailover.connect(
        URL, link_factory=link_factory(broker), exception_listener=heard.append
    ) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer("queue://orders")

        def listener(message: Message) -> None:
            got.append(message.text)
            if len(got) == 5:
                done.set()

        listen_then_reconnect(broker, connection, consumer, listener, count=5, ready=done)
        time.sleep(0.3)
        assert sorted(got[5:]) in ([], ["4"]), got  # at most the last one again
        assert got[:5] == ["0", "1", "2", "3", "4"]
        assert broker.violations == []


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=6),  # messages received before the loss
            st.sampled_from(["reattach", "fresh"]),
            st.sampled_from(
                [("reader",), ("heartbeat",), ("writer", "reader"), ("reader", "heartbeat")]
            ),
            st.integers(min_value=0, max_value=6),  # of them, read by the broker first
        ),
        min_size=1,
        max_size=4,
    ),
    ids=st.booleans(),
)
def test_f6_holds_under_any_losses(
    steps: list[tuple[int, str, tuple[str, ...], int]], ids: bool
) -> None:
    """Any receives interleaved with losses noticed in any way, reattached or reconnected,
    with part of the acknowledges read before the loss: every message is received, and a
    message comes again only if it was the last one handed out before a loss."""
    broker = FakeBroker(duplicate_detection=False)
    broker.start()
    total = 40
    try:
        with hafailover.connect(URL, link_factory=link_factory(broker)) as connection:
            session = connection.create_session(AckMode.AUTO)
            consumer = session.create_consumer("queue://orders")
            connection.start()
            put(broker, total, ids=ids)
            got: list[str] = []
            allowed_again: set[str] = set()
            for count, answer, noticed_by, read in steps:
                deadline = time.monotonic() + 2
                while len(consumer._buffer) < count and time.monotonic() < deadline:
                    time.sleep(0.002)  # prefetched, so that the receives do not wait
                with broker.paused():
                    for _ in range(count):
                        message = receive_or_count(consumer, 0.2)
                        if message is None:
                            break
                        if message != "failed":
                            got.append(message.text)
                    if got:
                        allowed_again.add(got[-1])
                    link = broker.current()
                    link.deliver(read)
                    broker.answers.append(answer)
                    before = connection.statistics().failovers
                    for thread in link.lose(noticed_by=noticed_by):
                        thread.join(5)
                deadline = time.monotonic() + 5
                while connection.statistics().failovers == before:
                    assert time.monotonic() < deadline, "no failover"
                    time.sleep(0.002)
            while (message := receive_or_count(consumer, 0.5)) is not None:
                if message != "failed":
                    got.append(message.text)
            assert sorted(set(got), key=int) == [str(n) for n in range(total)]
            again = [text for text in set(got) if got.count(text) > 1]
            assert set(again) <= allowed_again, (again, allowed_again, got)
            assert all(got.count(text) <= 1 + len(steps) for text in again)
            assert broker.violations == []
    finally:
        broker.stop()


def test_two_reconnects_in_a_row_still_drop_what_was_handed_out(broker: FakeBroker) -> None:
    """The acknowledges that drop the redeliveries after a first reconnect are lost to a
    second one: the broker delivers those messages once more, and they are dropped again."""
    with auto_consumer(broker, 5) as (connection, consumer):
        got: list[str] = []
        failures = 0
        for round_ in range(2):
            buffered(consumer, 5)  # the five, or their redeliveries
            with broker.paused():
                while (message := receive_or_count(consumer)) is not None:
                    if message == "failed":
                        failures += 1
                        continue
                    got.append(message.text)
                lose(broker, "fresh")
            wait_for_failovers(connection, round_ + 1)
        while (message := receive_or_count(consumer)) is not None:
            if message == "failed":
                failures += 1
                continue
            got.append(message.text)
        assert sorted(set(got)) == ["0", "1", "2", "3", "4"]
        again = [text for text in set(got) if got.count(text) > 1]
        assert again in ([], ["4"]), got  # only the last one handed out, "4", comes again
        assert failures == 2  # once per failover: the last message's acknowledge
        assert broker.violations == []


def test_a_copy_with_the_same_id_on_another_subscription_is_delivered(
    broker: FakeBroker,
) -> None:
    """The same sender's id on two queues, consumed by one session: the copy on the other
    queue is a message of its own, not the redelivery a reconnect made the session drop."""
    with hafailover.connect(URL, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        first = session.create_consumer("queue://orders")
        second = session.create_consumer("queue://audit")
        connection.start()
        with broker.lock:
            broker.queues["orders"].extend([Message("x", message_id="x"), Message("y")])
            broker.queues["audit"].append(Message("x, audit copy", message_id="x"))
        buffered(first, 2)
        buffered(second, 1)
        with broker.paused():
            taken = first.receive(1)
            assert taken is not None and taken.text == "x"
            # "y" has no sender's id: its acknowledge is the last, confirmed before more.
            taken = first.receive(1)
            assert taken is not None and taken.text == "y"
            lose(broker, "fresh")
        wait_for_failovers(connection, 1)
        with pytest.raises(AcknowledgeFailedError):  # "y"'s, the last handed out
            second.receive(5)
        copy = second.receive(5)
        assert copy is not None and copy.text == "x, audit copy"
        again = [m.text for m in iter(lambda: first.receive(0.3), None)]
        assert again in ([], ["y"])  # "x" was dropped


def test_one_report_when_the_message_being_handed_out_is_caught_by_a_reconnect(
    broker: FakeBroker,
) -> None:
    """A listener is running on the second message when a reconnect loses both
    acknowledges: the exception listener hears AcknowledgeFailed once (for the second),
    the first is dropped when it comes again, the second may be delivered again."""
    heard: list[hafailover.HaFailoverError] = []
    got: list[str] = []
    running = threading.Event()
    release = threading.Event()

    def listener(message: Message) -> None:
        got.append(message.text)
        if message.text == "1" and not running.is_set():
            running.set()
            release.wait(5)

    with hafailover.connect(
        URL, link_factory=link_factory(broker), exception_listener=heard.append
    ) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer("queue://orders")
        listen_then_reconnect(broker, connection, consumer, listener, count=2, ready=running)
        release.set()
        time.sleep(0.5)
        failures = [h for h in heard if isinstance(h, AcknowledgeFailedError)]
        assert len(failures) == 1, heard
        assert got.count("0") == 1 and got.count("1") in (1, 2), got


def test_an_unanswered_acknowledge_in_flight_is_reported_not_waited_for_forever(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the most acknowledges in flight and a broker that answers none of them, the
    next receive waits the call timeout for the oldest, then says that message may come
    again, and goes on."""
    monkeypatch.setattr(auto_rules, "PIPELINED_ACKS", 2)
    url = URL.replace("call_timeout=5s", "call_timeout=300ms")
    with auto_consumer(broker, 4, url=url) as (_connection, consumer):
        with broker.paused():
            assert [m.text for m in (consumer.receive(1) for _ in range(3)) if m] == [
                "0",
                "1",
                "2",
            ]
            started = time.monotonic()
            with pytest.raises(AcknowledgeFailedError, match="an earlier message"):
                consumer.receive()
            assert time.monotonic() - started < 3
        fourth = consumer.receive(5)
        assert fourth is not None and fourth.text == "3"


@contextlib.contextmanager
def auto_consumer(
    broker: FakeBroker, count: int, *, ids: bool = True, url: str = URL
) -> Iterator[tuple[hafailover.Connection, hafailover.Consumer]]:
    """A started AUTO consumer of queue://orders with ``count`` messages prefetched."""
    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer("queue://orders")
        connection.start()
        put(broker, count, ids=ids)
        buffered(consumer, count)
        yield connection, consumer


def listen_then_reconnect(
    broker: FakeBroker,
    connection: hafailover.Connection,
    consumer: hafailover.Consumer,
    listener: Callable[[Message], None],
    *,
    count: int,
    ready: threading.Event,
) -> None:
    """``count`` messages go to ``listener`` while the broker reads nothing; once ``ready``
    is set the connection is lost and the next one is a new session."""
    with broker.paused():
        put(broker, count)
        broker.push(broker.current())
        consumer.set_message_listener(listener)
        connection.start()
        assert ready.wait(5)
        lose(broker, "fresh")
    wait_for_failovers(connection, 1)


def lose(broker: FakeBroker, answer: str) -> None:
    """The connection dies, noticed by the reader; the next attempt is answered ``answer``."""
    broker.answers.append(answer)
    for thread in broker.current().lose(noticed_by=("reader",)):
        thread.join(5)


def receive_or_count(consumer: hafailover.Consumer, timeout: float = 0.3) -> Message | str | None:
    """The next message, None when none came, or "failed" when receive() said an
    acknowledge was lost."""
    try:
        return consumer.receive(timeout)
    except AcknowledgeFailedError:
        return "failed"


def wait_for_failovers(connection: hafailover.Connection, count: int) -> None:
    deadline = time.monotonic() + 5
    while connection.statistics().failovers < count:
        assert time.monotonic() < deadline, "no failover"
        time.sleep(0.002)
