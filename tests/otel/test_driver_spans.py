"""The driver's tracing hooks against the scripted broker: each send's span ends with its
outcome (confirmed, resent on the new broker, in doubt, refused), and each failover makes
one span with its report, every interleaving the same on every run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")

from opentelemetry.trace import SpanKind, StatusCode

import hafailover
from hafailover import AckMode, MessageTooLargeError, UnblockedError
from hafailover.driver import producer as producer_module
from tests.driver.fake import FakeBroker, link_factory
from tests.otel.spans import Spans, instrumented

pytestmark = pytest.mark.timeout(30)

URL = (
    "failover:(stomp://app:pw@live:61613,stomp://app:pw@backup:61613)"
    "?heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&call_timeout=5s"
)


@pytest.fixture
def spans() -> Iterator[Spans]:
    with instrumented() as recorded:
        yield recorded


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    started = FakeBroker()
    started.start()
    yield started
    started.stop()


@pytest.fixture
def connect(broker: FakeBroker) -> Iterator[Callable[..., hafailover.Connection]]:
    opened: list[hafailover.Connection] = []

    def open_one(**options: str) -> hafailover.Connection:
        extra = "".join(f"&{k}={v}" for k, v in options.items())
        connection = hafailover.connect(URL + extra, link_factory=link_factory(broker))
        opened.append(connection)
        return connection

    yield open_one
    for connection in opened:
        connection.close()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_a_send_in_doubt_ends_its_span_with_the_error_and_the_failover_names_it(
    spans: Spans, broker: FakeBroker, connect: Callable[..., hafailover.Connection]
) -> None:
    connection = connect(duplicate_detection="false")
    producer = connection.create_session().create_producer("queue://orders")
    producer.send("confirmed")
    broker.answers.append("fresh")
    with broker.paused():
        pending = producer.send_async("maybe")
        broker.current().deliver()  # stored; its receipt is lost with the link
        for thread in broker.current().lose(noticed_by=("reader",)):
            thread.join(5)
    with pytest.raises(UnblockedError):
        pending.result(5)
    assert pending.message is not None and pending.message.message_id is not None
    confirmed, doubtful = spans.wait_for(lambda: spans.of(SpanKind.PRODUCER), 2, "send")
    assert confirmed.status.status_code is StatusCode.UNSET
    assert doubtful.status.status_code is StatusCode.ERROR
    assert (doubtful.attributes or {})["error.type"] == "hafailover.errors.UnblockedError"
    assert (doubtful.attributes or {})["messaging.message.id"] == pending.message.message_id
    (failover,) = spans.wait_for(spans.failovers, 1, "failover")
    attributes = failover.attributes or {}
    assert attributes["hafailover.failover.in_doubt"] == 1
    assert attributes["hafailover.failover.in_doubt_ids"] == (pending.message.message_id,)
    assert attributes["hafailover.failover.outcome"] == "reconnected"


def test_a_send_resent_after_a_reconnect_ends_well_on_the_new_broker(
    spans: Spans, broker: FakeBroker, connect: Callable[..., hafailover.Connection]
) -> None:
    connection = connect()
    producer = connection.create_session().create_producer("queue://orders")
    broker.answers.append("fresh")
    with broker.paused():
        pending = producer.send_async("resent with its duplicate id")
        for thread in broker.current().lose(noticed_by=("reader",)):
            thread.join(5)
    pending.result(5)
    (send,) = spans.wait_for(lambda: spans.of(SpanKind.PRODUCER), 1, "send")
    attributes = send.attributes or {}
    assert send.status.status_code is StatusCode.UNSET
    (failover,) = spans.wait_for(spans.failovers, 1, "failover")
    assert (failover.attributes or {})["hafailover.failover.resent"] == 1
    assert connection.reports[0].resent == (attributes["messaging.message.id"],)


def test_a_send_refused_before_it_is_written_ends_its_span_with_the_refusal(
    spans: Spans, connect: Callable[..., hafailover.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(producer_module, "MAX_MESSAGE_BYTES", 200)
    producer = connect().create_session().create_producer("queue://orders")
    with pytest.raises(MessageTooLargeError):
        producer.send("x" * 500)
    (send,) = spans.of(SpanKind.PRODUCER)
    assert send.status.status_code is StatusCode.ERROR
    assert (send.attributes or {})["error.type"] == "hafailover.errors.MessageTooLargeError"


def test_receive_and_a_listener_each_make_one_span_per_message(
    spans: Spans, connect: Callable[..., hafailover.Connection]
) -> None:
    connection = connect()
    session = connection.create_session(AckMode.AUTO)
    producer = session.create_producer("queue://orders")
    for n in range(3):
        producer.send(f"m{n}")
    consumer = session.create_consumer("queue://orders")
    connection.start()
    first = consumer.receive(5)
    assert first is not None
    assert consumer.receive(0.05) is not None
    handled: list[str] = []
    consumer.set_message_listener(lambda message: handled.append(message.text))
    wait_until(lambda: len(handled) == 1, "the listener")
    receives = spans.wait_for(lambda: spans.of(SpanKind.CLIENT, "receive"), 2, "receive")
    processes = spans.wait_for(lambda: spans.of(SpanKind.CONSUMER, "process"), 1, "process")
    sends = spans.of(SpanKind.PRODUCER)
    assert len(receives) == 2 and len(processes) == 1 and len(sends) == 3
    # Each consuming span points at the send span of its message.
    send_ids = [s.context.span_id for s in sends]
    assert [r.links[0].context.span_id for r in receives] == send_ids[:2]
    assert processes[0].parent is not None and processes[0].parent.span_id == send_ids[2]
    assert (receives[0].attributes or {})["messaging.message.id"] == first.message_id
