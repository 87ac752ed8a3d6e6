"""Consumer-side duplicate suppression against RabbitMQ, which has no duplicate detection:
copies of one message stored twice are delivered once, and through a restart in the middle of
traffic, with the sends it caught resent under their ids, every message arrives exactly once."""

from __future__ import annotations

from collections import Counter

import pytest

import hafailover
from hafailover import AckMode, Message
from tests.interop.conftest import RabbitMQ, RabbitMQControl
from tests.interop.test_client_rabbitmq import failover_url, run_application, unique_queue

pytestmark = [pytest.mark.interop, pytest.mark.timeout(90)]


def deduplicating(url: str, window: int = 10_000) -> str:
    """The interop URL with duplicate ids stamped and resent, and a window on consumers."""
    return url.replace(
        "duplicate_detection=false", f"duplicate_detection=true&consumer_dedup={window}"
    )


def received(url: str, queue: str, *, dedup: int | None) -> tuple[list[str], int]:
    with hafailover.connect(url) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer(queue, dedup=dedup)
        connection.start()
        texts = []
        while (message := consumer.receive(2.0)) is not None:
            texts.append(message.text)
        return texts, consumer.duplicates_dropped


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_a_message_stored_twice_is_delivered_once(rabbitmq: RabbitMQ, protocol: str) -> None:
    url = deduplicating(failover_url(rabbitmq, protocol))
    queue = unique_queue(f"dedup-twice-{protocol}")
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        once = Message("once")
        producer.send(once)
        producer.send(once)  # the same object: the same id, and RabbitMQ stores both
        producer.send(Message("other"))
        producer.send(once)
        producer.send(once)
    texts, dropped = received(url, queue, dedup=None)  # the URL's window
    assert texts == ["once", "other"]
    assert dropped == 3
    # The copies were acknowledged: nothing is left for anyone.
    assert received(url, queue, dedup=0) == ([], 0)


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_without_a_window_every_stored_copy_is_delivered(rabbitmq: RabbitMQ, protocol: str) -> None:
    """The control: RabbitMQ itself delivers each stored copy."""
    url = deduplicating(failover_url(rabbitmq, protocol))
    queue = unique_queue(f"dedup-off-{protocol}")
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        once = Message("once")
        producer.send(once)
        producer.send(once)
    assert received(url, queue, dedup=0) == (["once", "once"], 0)


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_a_restart_mid_traffic_with_resends_delivers_each_message_exactly_once(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl, protocol: str
) -> None:
    url = deduplicating(failover_url(rabbitmq, protocol))
    outcome = run_application(url, unique_queue(f"dedup-{protocol}"), rabbitmq_control.restart)
    assert not outcome.errors, outcome.errors
    assert len(outcome.reports) == 1, [r.summary() for r in outcome.reports]
    assert not outcome.in_doubt  # with duplicate ids every caught send is resent
    assert not outcome.lost, sorted(outcome.lost)[:20]
    assert not outcome.unexpected, sorted(outcome.unexpected)[:20]
    assert outcome.duplicates == 0, Counter(outcome.received).most_common(3)
