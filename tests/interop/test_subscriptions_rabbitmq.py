"""Durable subscriptions and poison messages on RabbitMQ 3.10, as far as its mappings go:
a STOMP durable subscription keeps what is published while its subscriber is away (AMQP
1.0's does not: docs/brokers.md); RabbitMQ counts no failed deliveries, so the consumer's
own count stops a poison message after max_redeliveries + 1 deliveries, on both protocols."""

from __future__ import annotations

import time
import uuid

import pytest

import hafailover
from hafailover import AckMode, Message
from tests.interop.conftest import RabbitMQ
from tests.interop.test_client_rabbitmq import failover_url, unique_queue


def test_a_stomp_durable_subscription_keeps_what_is_published_while_away(
    rabbitmq: RabbitMQ,
) -> None:
    url = f"{failover_url(rabbitmq, 'stomp')}&client_id=hafailover-interop"
    topic = f"topic://hafailover-durable-{uuid.uuid4().hex[:10]}"
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        session.create_durable_consumer(topic, "board").close()
        session.create_producer(topic).send(Message(body="while away"))
    # A new connection, as the recreation after a failover makes one: the same name.
    with hafailover.connect(url) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_durable_consumer(topic, "board")
        connection.start()
        got = consumer.receive(10)
        assert got is not None
        assert got.body_bytes == b"while away"


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_a_poison_message_is_rejected_after_max_redeliveries(
    rabbitmq: RabbitMQ, protocol: str
) -> None:
    # With duplicate detection on (the default) a STOMP message carries its sender's id,
    # by which the consumer counts; RabbitMQ's own STOMP message-id changes per delivery.
    url = failover_url(rabbitmq, protocol).replace(
        "duplicate_detection=false", "duplicate_detection=true&max_redeliveries=2"
    )
    queue = unique_queue("poison")
    calls: list[int] = []

    def always_fails(message: Message) -> None:
        calls.append(message.delivery_count)
        raise RuntimeError("this message always fails")

    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        session.create_producer(queue).send(Message(body="poison"))
        consumer = session.create_consumer(queue)
        consumer.set_message_listener(always_fails)
        connection.start()
        deadline = time.monotonic() + 20
        while consumer.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert consumer.rejected == 1
        assert calls == [0, 0, 0]  # RabbitMQ counts nothing; the consumer counted three
        # Giving a failed message back is no failover on either protocol.
        assert connection.statistics().failovers == 0
        consumer.close()
        assert session.create_consumer(queue).receive(0.5) is None  # rejected: gone
