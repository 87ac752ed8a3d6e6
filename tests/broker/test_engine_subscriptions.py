"""The engine's JMS subscriptions: one active consumer on a durable subscription that is not
shared, shared subscriptions that are not durable, and finding a durable one by name."""

from __future__ import annotations

import pytest

from reference_broker.engine import AckMode, Engine, EngineConfig, Outcome
from reference_broker.message import ResourceLockedError
from reference_broker.records import QueueCreate, QueueDelete

T = "topic://prices"


@pytest.fixture
def engine() -> Engine:
    return Engine(EngineConfig(clock=lambda: 1_800_000_000.0))


def test_an_exclusive_consumer_is_alone_on_its_subscription(engine: Engine) -> None:
    first = engine.subscribe(engine.connect(), T, subscription="app.ticks", exclusive=True)
    other = engine.connect()
    with pytest.raises(ResourceLockedError, match="already has an active consumer"):
        engine.subscribe(other, T, subscription="app.ticks", exclusive=True)
    with pytest.raises(ResourceLockedError, match="already has an active consumer"):
        engine.subscribe(other, T, subscription="app.ticks")  # nor joins it unasked
    engine.close_consumer(first)
    engine.subscribe(other, T, subscription="app.ticks", exclusive=True)


def test_an_exclusive_consumer_cannot_join_a_shared_subscription_in_use(engine: Engine) -> None:
    engine.subscribe(engine.connect(), T, subscription="workers")
    engine.subscribe(engine.connect(), T, subscription="workers")  # shared: fine
    with pytest.raises(ResourceLockedError):
        engine.subscribe(engine.connect(), T, subscription="workers", exclusive=True)


def test_a_consumer_held_for_reattach_does_not_count(engine: Engine) -> None:
    held = engine.connect()
    engine.subscribe(held, T, subscription="app.ticks", exclusive=True)
    engine.pause_connection(held)  # its socket is gone; it gets nothing
    engine.subscribe(engine.connect(), T, subscription="app.ticks", exclusive=True)


def test_a_shared_subscription_that_is_not_durable_ends_with_its_last_consumer(
    engine: Engine,
) -> None:
    first = engine.subscribe(engine.connect(), T, shared_name="workers", ack_mode=AckMode.AUTO)
    second = engine.subscribe(engine.connect(), T, shared_name="workers", ack_mode=AckMode.AUTO)
    [queue] = engine.queues()
    assert queue == f"{T}::~shared.workers"
    for n in range(4):
        engine.send(T, str(n).encode(), persistent=True)
    deliveries = engine.poll(0.0)
    # Shared: each message once, spread over both consumers.
    assert sorted(d.message.body for d in deliveries) == [b"0", b"1", b"2", b"3"]
    assert {d.consumer_id for d in deliveries} == {first, second}
    assert engine.drain_records() == []  # not durable: nothing journaled
    engine.close_consumer(first)
    assert engine.queues() == [queue]
    engine.send(T, b"kept for the other", persistent=True)
    engine.close_consumer(second)
    assert engine.queues() == []


def test_a_shared_name_and_a_durable_name_are_apart(engine: Engine) -> None:
    engine.subscribe(engine.connect(), T, shared_name="s")
    engine.subscribe(engine.connect(), T, subscription="s")
    assert sorted(engine.queues()) == [f"{T}::s", f"{T}::~shared.s"]
    assert engine.drain_records() == [QueueCreate(f"{T}::s", T)]


def test_a_durable_subscription_is_found_by_its_name(engine: Engine) -> None:
    consumer = engine.subscribe(engine.connect(), T, subscription="app.ticks")
    engine.subscribe(engine.connect(), "queue://app.ticks")
    engine.subscribe(engine.connect(), "topic://other", shared_name="app.ticks")
    assert engine.subscription_topic("app.ticks") == T
    assert engine.subscription_topic("ticks") is None
    engine.close_consumer(consumer)
    engine.delete_subscription(T, "app.ticks")
    assert engine.drain_records()[-1] == QueueDelete(f"{T}::app.ticks")
    assert engine.subscription_topic("app.ticks") is None


def test_a_rejected_delivery_of_a_subscription_is_dead_lettered(engine: Engine) -> None:
    consumer = engine.subscribe(
        engine.connect(), T, subscription="app.ticks", ack_mode=AckMode.CLIENT_INDIVIDUAL
    )
    engine.send(T, b"poison", persistent=True)
    [delivery] = engine.poll(0.0)
    engine.settle(consumer, delivery.tag, Outcome.REJECTED)
    assert [m.body for m in engine.browse("queue://DLQ")] == [b"poison"]
    assert engine.browse(f"{T}::app.ticks") == []
