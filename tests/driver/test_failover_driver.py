"""The driver against a scripted broker: every way a loss can be noticed, in milliseconds.

These are the races that the end-to-end tests meet one run in five: a loss first noticed
by a write on an application's thread, noticed twice at once, a new link lost while it is
being restored, refused and exhausted attempts. Here the test decides every step (see
``fake.py``), so each interleaving runs the same way every time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import hafailover
from hafailover import (
    AckMode,
    DisconnectedError,
    FailoverNotice,
    HaFailoverError,
    UnblockedError,
)
from hafailover.core.failover import (
    Connected,
    Effect,
    Event,
    FailoverMachine,
    FailoverState,
    Restored,
)

from .fake import FakeBroker, FakeLink, link_factory

pytestmark = pytest.mark.timeout(30)

FAST = "heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&call_timeout=5s"


def url(**options: object) -> str:
    extra = "".join(f"&{k}={v}" for k, v in options.items())
    return f"failover:(stomp://app:pw@live:61613,stomp://app:pw@backup:61613)?{FAST}{extra}"


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class Heard:
    def __init__(self) -> None:
        self.errors: list[HaFailoverError] = []

    def __call__(self, error: HaFailoverError) -> None:
        self.errors.append(error)


def open_connection(broker: FakeBroker, heard: Heard, **options: object) -> hafailover.Connection:
    return hafailover.connect(
        url(**options), exception_listener=heard, link_factory=link_factory(broker)
    )


def failed_over(connection: hafailover.Connection, count: int = 1) -> Callable[[], bool]:
    return lambda: connection.statistics().failovers >= count and connection.broker is not None


def lose(link: FakeLink, *noticed_by: str) -> None:
    for thread in link.lose(noticed_by=noticed_by):
        thread.join(5)


@pytest.fixture
def heard() -> Heard:
    return Heard()


@pytest.fixture
def closing() -> Iterator[list[hafailover.Connection]]:
    connections: list[hafailover.Connection] = []
    yield connections
    for connection in connections:
        connection.close()


@pytest.mark.parametrize("answer", ["reattach", "fresh"])
def test_a_loss_first_noticed_by_a_write_on_the_application_thread_still_fails_over(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection], answer: str
) -> None:
    connection = open_connection(broker, heard)
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    producer.send("first")
    old = broker.current()
    with broker.paused():
        old.lose(noticed_by=("writer",))  # the reader never says a word
        broker.answers.append(answer)
        second = producer.send_async("second")  # its write fails: the first notice
    wait_until(failed_over(connection), "the failover")
    assert broker.current() is not old
    second.result(1)
    assert [m.text for m in broker.stored("orders")] == ["first", "second"]
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    notice = heard.errors[0]
    assert isinstance(notice, FailoverNotice) and notice.reattached == (answer == "reattach")
    assert "Bad file descriptor" in connection.reports[0].reason


def test_a_loss_noticed_by_the_reader_and_a_heartbeat_at_once_is_one_failover(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard)
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    with broker.paused():
        pending = producer.send_async("in flight")  # never reaches the broker
        lose(broker.current(), "reader", "heartbeat")
    wait_until(failed_over(connection), "the failover")
    pending.result(1)  # replayed after the reattach: never lost, never in doubt
    time.sleep(0.05)  # a second notice would have started a second failover by now
    assert connection.statistics().failovers == 1
    assert len(connection.reports) == 1
    assert connection.statistics().replayed >= 1
    assert [m.text for m in broker.stored("orders")] == ["in flight"]


def test_a_late_notice_about_a_replaced_link_changes_nothing(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard)
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    old = broker.current()
    lose(old, "reader")
    wait_until(failed_over(connection), "the failover")
    # The old link's heartbeat thread wakes up late and says the old link is gone.
    connection.link_lost(old, "heart-beat timeout")
    producer.send("after")
    assert connection.statistics().failovers == 1
    assert connection.state == "reattached"


def test_a_link_lost_while_its_sessions_are_restored_fails_that_attempt_only(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard)
    closing.append(connection)
    connection.create_session(AckMode.CLIENT).create_consumer("queue://work")
    producer = connection.create_session().create_producer("queue://orders")
    # The next attempt gets a new session whose link dies before the consumer is
    # subscribed on it again; the one after that works.
    broker.answers.extend(["fresh, then lost", "fresh"])
    with broker.paused():
        pending = producer.send_async("in flight")
        lose(broker.current(), "reader")
    wait_until(failed_over(connection), "the failover")
    pending.result(1)  # resent on the new session with its duplicate id (F13)
    new = broker.current()
    wait_until(lambda: new.session is not None and "sub-1" in new.session.subscriptions, "sub")
    assert connection.statistics().failovers == 1
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    notice = heard.errors[0]
    assert isinstance(notice, FailoverNotice) and not notice.reattached
    assert connection.reports[0].attempts >= 2
    assert [m.text for m in broker.stored("orders")] == ["in flight"]


def test_an_attempt_refused_then_one_that_succeeds(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard)
    closing.append(connection)
    broker.answers.extend(["refuse", "refuse", "reattach"])
    lose(broker.current(), "heartbeat")
    wait_until(failed_over(connection), "the failover")
    assert connection.reports[0].attempts == 3


def test_attempts_exhausted_fail_every_blocked_call_with_disconnect(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard, reconnect_attempts=3)
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    broker.answers.extend(["refuse"] * 3)
    blocked: list[BaseException] = []

    def send_blocked() -> None:
        try:
            producer.send("waits for the failover")
        except HaFailoverError as exc:
            blocked.append(exc)

    with broker.paused():
        pending = producer.send_async("never confirmed")
        lose(broker.current(), "reader")
        sender = threading.Thread(target=send_blocked)
        sender.start()
        sender.join(5)
    assert not sender.is_alive()
    with pytest.raises(DisconnectedError):
        pending.result(1)
    assert len(blocked) == 1 and isinstance(blocked[0], DisconnectedError)
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    assert isinstance(heard.errors[0], DisconnectedError)
    with pytest.raises(DisconnectedError):
        producer.send("later")


def test_f3_a_reconnect_releases_an_unstamped_send_as_in_doubt(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    connection = open_connection(broker, heard, duplicate_detection="false")
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    broker.answers.append("fresh")
    with broker.paused():
        pending = producer.send_async("maybe")
        broker.current().deliver()  # stored; its receipt is lost with the link
        lose(broker.current(), "reader")
    with pytest.raises(UnblockedError):
        pending.result(5)
    assert pending.message is not None
    assert connection.reports[0].in_doubt == (pending.message.message_id,)


def put(broker: FakeBroker, queue: str, text: str) -> None:
    """A message another client sent, waiting on the broker."""
    message = hafailover.Message(body=text)
    message.ensure_message_id()
    with broker.lock:
        broker.queues[queue].append(message)


def receive_text(consumer: hafailover.Consumer, text: str, timeout: float = 5.0) -> None:
    """Receive until the message ``text`` comes (redeliveries of earlier ones are
    acknowledged and skipped); fail if it does not come in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = consumer.receive(0.05)
        except HaFailoverError:
            continue
        if message is None:
            continue
        with contextlib.suppress(HaFailoverError):  # F8: stale after the failover
            message.acknowledge()
        if message.text == text:
            return
    raise AssertionError(f"{text!r} never arrived: the consumer stalled")


def consumer_sees_a_write_notice_loss(
    broker: FakeBroker,
    heard: Heard,
    closing: list[hafailover.Connection],
    *,
    refused_for: float,
    answers: list[str],
) -> tuple[hafailover.Connection, hafailover.Consumer]:
    """A CLIENT consumer whose link dies silently; the first notice is the write of its
    acknowledge (``[Errno 9] Bad file descriptor``), as in issue 17. Then every attempt
    is refused for ``refused_for`` seconds, and ``answers`` follow."""
    connection = open_connection(broker, heard, reconnect_attempts=-1)
    closing.append(connection)
    consumer = connection.create_session(AckMode.CLIENT).create_consumer("queue://work")
    connection.start()
    put(broker, "work", "before")
    message = consumer.receive(5)
    assert message is not None and message.text == "before"
    broker.refuse_until = time.monotonic() + refused_for
    broker.answers.extend(answers)
    broker.current().lose(noticed_by=("writer",))  # the reader never says a word
    # The write fails: the first notice of the loss (F8: the message comes again).
    with contextlib.suppress(HaFailoverError):
        message.acknowledge()
    return connection, consumer


@pytest.mark.parametrize("answer", ["reattach", "fresh"])
def test_issue_17_a_link_reported_lost_while_an_attempt_opens_it_is_not_restored(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection], answer: str
) -> None:
    """Attempts are refused for a while (a backup that has not taken over); then one
    opens a link whose reader reports it lost before the driver has made it the
    connection's. That notice must fail the attempt: restored on the dead link, a
    consumer waiting in receive() writes nothing, and nothing reports the loss again."""
    connection, consumer = consumer_sees_a_write_notice_loss(
        broker, heard, closing, refused_for=0.3, answers=[f"{answer}, then reported lost", answer]
    )
    put(broker, "work", "after")
    receive_text(consumer, "after")
    assert broker.refused >= 1
    assert connection.statistics().failovers == 1
    report = connection.reports[0]
    assert "Bad file descriptor" in report.reason
    assert report.attempts >= broker.refused + 2  # the refused ones, the dead one, the good one
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    assert isinstance(heard.errors[0], FailoverNotice)
    assert not broker.current().dead


def test_issue_17_the_first_connection_does_not_take_a_link_reported_lost_while_opening(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    broker.answers.extend(["fresh, then reported lost", "fresh"])
    connection = open_connection(broker, heard, initial_connect_attempts=3)
    closing.append(connection)
    consumer = connection.create_session(AckMode.CLIENT).create_consumer("queue://work")
    connection.start()
    put(broker, "work", "first")
    receive_text(consumer, "first")
    assert len(broker.links) == 2 and broker.links[0].dead and not broker.current().dead
    # The dead link was never the connection's: no failover, nothing to tell (F12).
    assert connection.statistics().failovers == 0 and heard.errors == []


def test_issue_17_a_local_error_inside_an_attempt_is_retried_not_the_end(
    broker: FakeBroker, heard: Heard, closing: list[hafailover.Connection]
) -> None:
    """An attempt that meets a local error (here amqp_io's reader-thread guard) is one
    failed attempt; it used to end reconnection with reconnect_attempts=-1."""
    connection, consumer = consumer_sees_a_write_notice_loss(
        broker, heard, closing, refused_for=0.2, answers=["illegal", "reattach"]
    )
    put(broker, "work", "after")
    receive_text(consumer, "after")
    assert connection.statistics().failovers == 1
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    assert isinstance(heard.errors[0], FailoverNotice)


def test_f2_f10_reconnection_that_ends_on_a_driver_bug_tells_the_listener(
    broker: FakeBroker,
    heard: Heard,
    closing: list[hafailover.Connection],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However reconnection ends, blocked calls fail with DISCONNECT and the listener
    hears it: never a connection that silently stops trying."""
    connection = open_connection(broker, heard, reconnect_attempts=-1)
    closing.append(connection)
    producer = connection.create_session().create_producer("queue://orders")
    handle = FailoverMachine.handle

    def buggy(machine: FailoverMachine, event: Event) -> list[Effect]:
        # A driver bug: an event the machine has no transition for, mid-failover.
        if isinstance(event, Connected) and machine.state is FailoverState.FAILING_OVER:
            return handle(machine, Restored())
        return handle(machine, event)

    monkeypatch.setattr(FailoverMachine, "handle", buggy)
    broker.answers.append("reattach")
    with broker.paused():
        pending = producer.send_async("in flight")
        lose(broker.current(), "reader")
    with pytest.raises(DisconnectedError):
        pending.result(5)
    wait_until(lambda: len(heard.errors) == 1, "the listener")
    assert isinstance(heard.errors[0], DisconnectedError)
    with pytest.raises(DisconnectedError):
        producer.send("later")
