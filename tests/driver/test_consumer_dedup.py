"""Consumer-side duplicate suppression against the scripted broker: a copy of a message the
consumer had delivered and acknowledged is acknowledged and dropped; one it had not (not
yet acknowledged, given back, rolled back) is delivered. Milliseconds, no real broker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import hafailover
from hafailover import AckMode, ConfigurationError, InvalidURLError, Message

from .fake import FAST_URL, FakeBroker, link_factory

pytestmark = pytest.mark.timeout(30)

URL = FAST_URL


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker(duplicate_detection=False)  # it stores every copy, as RabbitMQ does
    started.start()
    yield started
    started.stop()


@pytest.fixture
def connection(broker: FakeBroker) -> Iterator[hafailover.Connection]:
    opened = hafailover.connect(f"{URL}&consumer_dedup=100", link_factory=link_factory(broker))
    yield opened
    opened.close()


def put(broker: FakeBroker, *messages: Message) -> None:
    with broker.lock:
        broker.queues["orders"].extend(messages)


def texts(consumer: hafailover.Consumer, timeout: float = 0.3) -> list[str]:
    got = []
    while (message := consumer.receive(timeout)) is not None:
        got.append(message.text)
        if consumer.session.ack_mode in (AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL):
            message.acknowledge()
    return got


def copy(message_id: str, text: str) -> Message:
    return Message(text, message_id=message_id)


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK, AckMode.CLIENT_INDIVIDUAL])
def test_a_copy_of_an_acknowledged_message_is_acknowledged_and_dropped(
    broker: FakeBroker, connection: hafailover.Connection, mode: AckMode
) -> None:
    session = connection.create_session(mode)
    consumer = session.create_consumer("queue://orders")
    connection.start()
    put(broker, copy("m1", "first"), copy("m2", "second"))
    assert texts(consumer) == ["first", "second"]
    put(broker, copy("m1", "first again"), copy("m3", "third"))
    assert texts(consumer) == ["third"]
    assert consumer.duplicates_dropped == 1
    assert connection.statistics().duplicates_dropped == 1
    with broker.lock:  # the dropped copy was acknowledged: the broker holds nothing
        assert all(not s.unacked for s in broker.sessions.values())


def test_a_copy_of_a_message_still_held_is_dropped_and_the_held_one_comes_back_if_it_must(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    """CLIENT modes: a copy of a message the application holds unacknowledged is dropped
    (acknowledged on the wire); if the held one's acknowledge is lost with a failover, the
    broker delivers it again, and that is delivered."""
    session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
    consumer = session.create_consumer("queue://orders")
    connection.start()
    put(broker, copy("m1", "first"), copy("m1", "copy"), copy("m2", "second"))
    first = consumer.receive(1)
    second = consumer.receive(1)
    assert first is not None and second is not None
    assert (first.text, second.text) == ("first", "second")
    assert consumer.duplicates_dropped == 1
    broker.answers.append("fresh")  # the session is lost: first and second go back
    for thread in broker.current().lose(noticed_by=("reader",)):
        thread.join(5)
    with pytest.raises(hafailover.StaleAcknowledgeError):
        first.acknowledge()
    # Both delivered again, once each, and acknowledged (the broker may give back the copy
    # too, if its acknowledge had not reached it: whichever comes first is delivered, the
    # other is a copy of what the application holds).
    again = []
    while (message := consumer.receive(1.0)) is not None:
        again.append(message.message_id)
        message.acknowledge()
    assert sorted(again) == ["m1", "m2"]
    dropped = consumer.duplicates_dropped
    put(broker, copy("m1", "third copy"))
    assert consumer.receive(0.3) is None
    assert consumer.duplicates_dropped == dropped + 1


def test_a_committed_id_is_dropped_and_a_rolled_back_one_delivered(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    session = connection.create_session(AckMode.SESSION_TRANSACTED)
    consumer = session.create_consumer("queue://orders")
    connection.start()
    put(broker, copy("c1", "committed"))
    message = consumer.receive(1)
    assert message is not None
    session.commit()
    put(broker, copy("r1", "rolled back"))
    message = consumer.receive(1)
    assert message is not None and message.text == "rolled back"
    session.rollback()  # given back: its redelivery is a delivery, not a duplicate
    again = consumer.receive(1)
    assert again is not None and again.text == "rolled back"
    session.commit()
    put(broker, copy("c1", "committed, sent again"), copy("r1", "rolled back, sent again"))
    assert consumer.receive(0.3) is None
    assert consumer.duplicates_dropped == 2


def test_the_window_forgets_the_oldest(broker: FakeBroker) -> None:
    with hafailover.connect(f"{URL}&consumer_dedup=2", link_factory=link_factory(broker)) as c:
        consumer = c.create_session(AckMode.AUTO).create_consumer("queue://orders")
        c.start()
        put(broker, copy("a", "a"), copy("b", "b"), copy("c", "c"))
        assert texts(consumer) == ["a", "b", "c"]
        put(broker, copy("a", "a again"), copy("c", "c again"))
        assert texts(consumer) == ["a again"]  # a had left the window of 2; c had not


def test_off_by_default_and_per_consumer(broker: FakeBroker) -> None:
    with hafailover.connect(URL, link_factory=link_factory(broker)) as c:
        session = c.create_session(AckMode.AUTO)
        plain = session.create_consumer("queue://orders")
        c.start()
        put(broker, copy("x", "x"), copy("x", "x again"))
        assert texts(plain) == ["x", "x again"]
        plain.close()
        deduplicating = session.create_consumer("queue://orders", dedup=10)
        put(broker, copy("y", "y"), copy("y", "y again"))
        assert texts(deduplicating) == ["y"]
        with pytest.raises(ConfigurationError, match="dedup must be a whole number"):
            session.create_consumer("queue://orders", dedup=-1)
    with pytest.raises(InvalidURLError, match="consumer_dedup"):
        hafailover.connect(f"{URL}&consumer_dedup=lots", link_factory=link_factory(broker))


def test_a_message_whose_receive_raised_is_delivered_when_it_comes_again(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    """F6: an AUTO receive whose acknowledge could not be sent raises instead of returning
    the message; the application never had it, so its redelivery is not a duplicate."""
    session = connection.create_session(AckMode.AUTO)
    consumer = session.create_consumer("queue://orders")
    connection.start()
    put(broker, copy("m1", "first"))
    wait_buffered(consumer, 1)
    with broker.paused():
        broker.current().lose(noticed_by=("writer",))  # the acknowledge's write fails
        broker.answers.append("fresh")
        with pytest.raises(hafailover.AcknowledgeFailedError):
            consumer.receive(1)
    again = consumer.receive(5)  # the broker gave it back with the old session
    assert again is not None and again.text == "first"
    assert consumer.duplicates_dropped == 0
    put(broker, copy("m1", "a copy"))  # now the application has had it: a copy is dropped
    assert consumer.receive(0.3) is None
    assert consumer.duplicates_dropped == 1


def wait_buffered(consumer: hafailover.Consumer, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(consumer._buffer) < count:
        assert time.monotonic() < deadline, "nothing was delivered"
        time.sleep(0.002)


def test_a_kept_window_is_one_consumers_and_comes_back_to_the_next(
    broker: FakeBroker, tmp_path: object
) -> None:
    """consumer_dedup_file: a second consumer cannot share the file (its lock); once the
    first closes, the next consumer starts from the ids it kept."""
    path = f"{tmp_path}/window"
    url = f"{URL}&consumer_dedup=100&consumer_dedup_file={path}"
    with hafailover.connect(url, link_factory=link_factory(broker)) as connection:
        session = connection.create_session(AckMode.AUTO)
        first = session.create_consumer("queue://orders")
        with pytest.raises(ConfigurationError, match="in use by another consumer"):
            session.create_consumer("queue://orders")
        connection.start()
        put(broker, copy("m1", "first"))
        assert texts(first) == ["first"]
        first.close()
        again = session.create_consumer("queue://orders")
        put(broker, copy("m1", "first again"), copy("m2", "second"))
        assert texts(again) == ["second"]
        with pytest.raises(ConfigurationError, match="dedup=0 has none"):
            session.create_consumer("queue://orders", dedup=0, dedup_file=f"{path}-2")
    with pytest.raises(InvalidURLError, match="consumer_dedup=0 has none"):
        hafailover.connect(f"{URL}&consumer_dedup_file={path}")
    with pytest.raises(InvalidURLError, match="no such directory"):
        hafailover.connect(f"{URL}&consumer_dedup=5&consumer_dedup_file={path}/nowhere/x")


def test_a_closed_consumer_leaves_nothing_pending_in_its_session(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    """What a CLIENT consumer held when it closed went back with its subscription: the ids
    it would have remembered at their acknowledge are dropped with it (the session kept
    them, and the consumer with them, until a reconnect)."""
    session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
    consumer = session.create_consumer("queue://orders")
    connection.start()
    put(broker, copy("m1", "first"))
    held = consumer.receive(5)
    assert held is not None
    assert session._dedup_pending
    consumer.close()
    assert session._dedup_pending == {}


def test_an_acknowledge_not_confirmed_returns_once_written_and_its_loss_is_dropped(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    """Message.acknowledge(confirm=False) returns while the broker has not even read it; a
    failover that loses it makes the broker deliver the message again, and the window,
    which took its id when it was written, drops that copy."""
    consumer, (first, second) = held(broker, connection, copy("m1", "first"), copy("m2", "second"))
    with broker.paused():  # nothing is read or answered
        acknowledging = threading.Thread(target=first.acknowledge, kwargs={"confirm": False})
        acknowledging.start()
        acknowledging.join(2)
        assert not acknowledging.is_alive(), "acknowledge(confirm=False) waited for the broker"
        failed: list[BaseException] = []
        waiting = threading.Thread(target=_acknowledge_into, args=(second, failed), daemon=True)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive(), "a confirmed acknowledge returned before the broker answered"
        threads = broker.current().lose(noticed_by=("reader",))  # both never arrive
        broker.answers.append("fresh")
    for thread in threads:
        thread.join(5)
    waiting.join(5)
    assert [type(e) for e in failed] == [hafailover.UnblockedError]  # its outcome unknown
    # The broker gave both back: "second" is delivered, the copy of "first" is dropped.
    again = consumer.receive(5)
    assert again is not None and again.text == "second"
    assert consumer.receive(0.3) is None
    deadline = time.monotonic() + 5
    while consumer.duplicates_dropped < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert consumer.duplicates_dropped == 1


def test_an_acknowledge_not_confirmed_whose_write_fails_raises_and_its_message_comes_again(
    broker: FakeBroker, connection: hafailover.Connection
) -> None:
    """Known while its caller is still there: a write that fails raises, confirmed or not,
    and the message's id stays out of the window, so its redelivery is delivered."""
    consumer, (first,) = held(broker, connection, copy("m1", "first"))
    with broker.paused():
        broker.current().lose(noticed_by=("writer",))  # the acknowledge's write fails
        broker.answers.append("fresh")
        with pytest.raises(hafailover.AcknowledgeFailedError, match="acknowledge failed"):
            first.acknowledge(confirm=False)
    again = consumer.receive(5)  # the broker gave it back with the old session
    assert again is not None and again.text == "first"
    assert consumer.duplicates_dropped == 0


def held(
    broker: FakeBroker, connection: hafailover.Connection, *messages: Message
) -> tuple[hafailover.Consumer, list[Message]]:
    """A started CLIENT_INDIVIDUAL consumer of queue://orders holding ``messages``."""
    consumer = connection.create_session(AckMode.CLIENT_INDIVIDUAL).create_consumer(
        "queue://orders"
    )
    connection.start()
    put(broker, *messages)
    received = [consumer.receive(5) for _ in messages]
    assert None not in received, received
    return consumer, [m for m in received if m is not None]


def _acknowledge_into(message: Message, failed: list[BaseException]) -> None:
    try:
        message.acknowledge()
    except hafailover.HaFailoverError as exc:
        failed.append(exc)
