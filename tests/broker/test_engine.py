"""The messaging engine: unit tests of each rule, then a stateful model test that drives the
engine with random operations (sends, consumers, acks, nacks, transactions, connection drops,
crashes) and checks it against a plain re-statement of the rules, plus recovery equivalence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from reference_broker.engine import (
    MESSAGE_OVERHEAD,
    AckMode,
    Delivery,
    Engine,
    EngineConfig,
    Outcome,
    UnknownAddressError,
    UnknownConnectionError,
    UnknownConsumerError,
    UnknownDeliveryError,
    UnknownTransactionError,
)
from reference_broker.message import (
    BrokerError,
    InvalidRequestError,
    Message,
    NotFoundError,
    ResourceLockedError,
)
from reference_broker.records import (
    CheckpointBegin,
    CheckpointEnd,
    DeadLetter,
    DeliveryCount,
    DuplicateId,
    IdWatermark,
    MessageAck,
    MessageAdd,
    QueueCreate,
    QueueDelete,
    Record,
    RecordType,
    TxAck,
    TxAdd,
    TxCommit,
    TxDuplicateId,
    TxRollback,
    decode,
)

Q = "queue://orders"
DLQ = "queue://DLQ"


def send(engine: Engine, address: str, body: bytes = b"", **options: Any) -> int:
    """Send a message that must not be a duplicate; its id."""
    message_id = engine.send(address, body, **options)
    assert message_id is not None, "dropped as a duplicate"
    return message_id


def ids(deliveries: Iterable[Delivery]) -> list[int]:
    return [d.message.id for d in deliveries]


def round_trip(records: Iterable[Record]) -> list[Record]:
    return [decode(*r.encode()) for r in records]


def recovered(engine: Engine, records: list[Record]) -> Engine:
    return Engine.recover(round_trip(records), engine.config)


NOW = 1_800_000_000.0  # the engines' wall clock in these tests: records carry it


@pytest.fixture
def engine() -> Engine:
    return Engine(EngineConfig(clock=lambda: NOW))


# --- queues and dispatch ----------------------------------------------------------------------


def test_a_queue_delivers_in_fifo_order(engine: Engine) -> None:
    conn = engine.connect()
    sent = [send(engine, Q, b"%d" % i) for i in range(5)]
    consumer = engine.subscribe(conn, Q)
    deliveries = engine.poll(0.0)
    assert ids(deliveries) == sent
    assert [d.message.body for d in deliveries] == [b"0", b"1", b"2", b"3", b"4"]
    assert all(d.consumer_id == consumer and not d.redelivered for d in deliveries)
    assert engine.poll(0.0) == []


def test_consumers_with_room_are_served_round_robin(engine: Engine) -> None:
    conn = engine.connect()
    a = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    b = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=1)
    c = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    for i in range(7):
        engine.send(Q, b"%d" % i)
    # b fills its window of one at once; a and c share the rest in turn.
    assert [d.consumer_id for d in engine.poll(0.0)] == [a, b, c, a, c, a, c]


def test_closing_a_consumer_keeps_the_round_robin_turn(engine: Engine) -> None:
    conn = engine.connect()
    a, b, c = (engine.subscribe(conn, Q) for _ in range(3))
    engine.send(Q, b"")
    engine.send(Q, b"")
    assert [d.consumer_id for d in engine.poll(0.0)] == [a, b]
    engine.close_consumer(a)
    engine.send(Q, b"")
    engine.send(Q, b"")
    assert [d.consumer_id for d in engine.poll(0.0)] == [c, b]


def test_the_window_bounds_unacknowledged_deliveries(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=2)
    for _ in range(5):
        engine.send(Q, b"x" * 1000)
    first = engine.poll(0.0)
    assert len(first) == 2
    # A slow consumer holds two; the other three stay in the queue, not in a buffer of its own.
    assert engine.stats().messages == 3
    assert engine.poll(0.0) == []
    engine.ack(consumer, first[0].tag)
    assert len(engine.poll(0.0)) == 1
    assert engine.consumer_info(consumer).unacked == 2


def test_credit_is_spent_per_delivery_and_drained(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, credit=0)
    for _ in range(5):
        engine.send(Q, b"")
    assert engine.poll(0.0) == []
    engine.add_credit(consumer, 2)
    assert len(engine.poll(0.0)) == 2
    assert engine.consumer_info(consumer).credit == 0
    engine.set_credit(consumer, 10)
    assert len(engine.poll(0.0)) == 3
    assert engine.drain(consumer) == 7
    assert engine.consumer_info(consumer).credit == 0
    engine.set_credit(consumer, None)
    engine.send(Q, b"")
    assert len(engine.poll(0.0)) == 1
    assert engine.consumer_info(consumer).credit is None  # unlimited stays unlimited
    with pytest.raises(InvalidRequestError, match="unlimited credit"):
        engine.drain(consumer)


def test_higher_priority_first_and_fifo_within_a_priority(engine: Engine) -> None:
    conn = engine.connect()
    low = send(engine, Q, b"", priority=1)
    mid1 = send(engine, Q, b"", priority=4)
    high = send(engine, Q, b"", priority=9)
    mid2 = send(engine, Q, b"")
    engine.subscribe(conn, Q)
    assert ids(engine.poll(0.0)) == [high, mid1, mid2, low]


def test_expired_messages_are_not_delivered(engine: Engine) -> None:
    conn = engine.connect()
    stale = send(engine, Q, b"", persistent=True, expiration=10.0)
    fresh = send(engine, Q, b"", persistent=True, expiration=20.0)
    forever = send(engine, Q, b"", persistent=True)
    engine.drain_records()
    engine.subscribe(conn, Q)
    assert ids(engine.poll(15.0)) == [fresh, forever]
    assert MessageAck(Q, stale) in engine.drain_records()
    assert engine.stats().expired == 1


def test_expire_sweeps_queues_nobody_consumes(engine: Engine) -> None:
    engine.send(Q, b"", persistent=True, expiration=1.0)
    keep = send(engine, Q, b"", persistent=True, expiration=3.0)
    engine.send(Q, b"", persistent=True, expiration=2.0)
    engine.drain_records()
    assert engine.expire(2.5) == 2
    assert [m.id for m in engine.browse(Q)] == [keep]
    assert len(engine.drain_records()) == 2
    assert engine.stats().queues[0].expired == 2


def test_paused_connections_get_nothing_until_resumed(engine: Engine) -> None:
    conn = engine.connect()
    engine.subscribe(conn, Q)
    engine.pause_connection(conn)
    engine.send(Q, b"")
    assert engine.poll(0.0) == []
    engine.resume_connection(conn)
    assert len(engine.poll(0.0)) == 1


# --- acknowledgement --------------------------------------------------------------------------


def test_auto_ack_settles_on_delivery(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q)
    sent = send(engine, Q, b"", persistent=True)
    assert sent is not None
    [delivery] = engine.poll(0.0)
    assert MessageAck(Q, sent) in engine.drain_records()
    with pytest.raises(UnknownDeliveryError, match="auto ack mode"):
        engine.ack(consumer, delivery.tag)
    assert engine.stats().in_flight == 0


def test_client_ack_is_cumulative(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT)
    sent = [send(engine, Q, b"", persistent=True) for _ in range(4)]
    deliveries = engine.poll(0.0)
    engine.drain_records()
    assert engine.ack(consumer, deliveries[2].tag) == 3
    assert engine.drain_records() == [MessageAck(Q, i) for i in sent[:3]]
    assert engine.consumer_info(consumer).unacked == 1
    with pytest.raises(UnknownDeliveryError, match=f"no unsettled delivery {deliveries[0].tag}"):
        engine.ack(consumer, deliveries[0].tag)


def test_client_individual_ack_settles_one(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    for _ in range(3):
        engine.send(Q, b"")
    deliveries = engine.poll(0.0)
    assert engine.ack(consumer, deliveries[1].tag) == 1
    assert engine.consumer_info(consumer).unacked == 2


def test_nack_returns_the_message_to_the_head_in_original_order(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=3)
    sent = [send(engine, Q, b"", persistent=True) for _ in range(5)]
    d = engine.poll(0.0)
    engine.drain_records()
    engine.nack(consumer, d[0].tag)
    engine.nack(consumer, d[2].tag)
    assert engine.drain_records() == [DeliveryCount(Q, sent[0], 1), DeliveryCount(Q, sent[2], 1)]
    # The later one goes back behind the earlier one, not in front of it.
    assert [m.id for m in engine.browse(Q)] == [sent[0], sent[2], sent[3], sent[4]]
    again = engine.poll(0.0)
    assert ids(again) == [sent[0], sent[2]]
    assert [(x.redelivered, x.delivery_count) for x in again] == [(True, 1), (True, 1)]


def test_release_does_not_count_a_failed_attempt(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    engine.send(Q, b"", persistent=True)
    [d] = engine.poll(0.0)
    engine.drain_records()
    engine.settle(consumer, d.tag, Outcome.RELEASED)
    assert engine.drain_records() == []
    [again] = engine.poll(0.0)
    assert (again.redelivered, again.delivery_count) == (True, 0)


def test_closing_a_consumer_returns_its_deliveries(engine: Engine) -> None:
    conn = engine.connect()
    first = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT)
    sent = [send(engine, Q, b"") for _ in range(3)]
    engine.poll(0.0)
    engine.close_consumer(first)
    second = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT)
    again = engine.poll(0.0)
    assert ids(again) == sent
    assert all(d.redelivered and d.delivery_count == 1 for d in again)
    with pytest.raises(UnknownConsumerError):
        engine.ack(first, 1)
    assert engine.consumer_info(second).unacked == 3


def test_the_last_failed_attempt_dead_letters() -> None:
    engine = Engine(EngineConfig(max_delivery_attempts=2))
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, Q, b"body", headers={"h": "1"}, persistent=True, priority=7)
    engine.nack(consumer, engine.poll(0.0)[0].tag)
    engine.nack(consumer, engine.poll(0.0)[0].tag)
    records = engine.drain_records()
    assert records[-3:] == [
        DeliveryCount(Q, sent, 1),
        QueueCreate(DLQ, DLQ),
        DeadLetter(Q, sent, DLQ, sent + 1),
    ]
    assert engine.browse(Q) == []
    [copy] = engine.browse(DLQ)
    assert copy.id == sent + 1
    assert copy.body == b"body"
    assert copy.priority == 7
    assert copy.persistent
    assert dict(copy.headers) == {
        "h": "1",
        "_AMQ_ORIG_ADDRESS": Q,
        "_AMQ_ORIG_QUEUE": Q,
        "_AMQ_ORIG_MESSAGE_ID": str(sent),
    }
    stats = engine.stats()
    assert stats.dead_lettered == 1
    assert {q.name: q.dead_lettered for q in stats.queues} == {Q: 1, DLQ: 0}
    assert recovered(engine, [*records]).persistent_state() == engine.persistent_state()


def test_rejected_dead_letters_at_once(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, Q, b"")
    engine.settle(consumer, engine.poll(0.0)[0].tag, Outcome.REJECTED)
    assert [m.headers["_AMQ_ORIG_MESSAGE_ID"] for m in engine.browse(DLQ)] == [str(sent)]


def test_the_dead_letter_queue_keeps_what_fails_in_it() -> None:
    engine = Engine(EngineConfig(max_delivery_attempts=1))
    conn = engine.connect()
    consumer = engine.subscribe(conn, DLQ, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, DLQ, b"")
    engine.settle(consumer, engine.poll(0.0)[0].tag, Outcome.REJECTED)
    engine.nack(consumer, engine.poll(0.0)[0].tag)
    [again] = engine.poll(0.0)
    assert (again.message.id, again.delivery_count) == (sent, 2)


def test_without_a_dead_letter_queue_the_last_attempt_drops() -> None:
    engine = Engine(EngineConfig(max_delivery_attempts=1, dead_letter_queue=None))
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, Q, b"", persistent=True)
    engine.nack(consumer, engine.poll(0.0)[0].tag)
    assert engine.drain_records()[-1] == MessageAck(Q, sent)
    assert engine.queues() == [Q]


def test_unlimited_delivery_attempts() -> None:
    engine = Engine(EngineConfig(max_delivery_attempts=None))
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    engine.send(Q, b"")
    for _ in range(50):
        engine.nack(consumer, engine.poll(0.0)[0].tag)
    assert engine.poll(0.0)[0].delivery_count == 50


# --- topics -----------------------------------------------------------------------------------

T = "topic://prices"


def test_each_subscription_gets_its_own_copy(engine: Engine) -> None:
    conn = engine.connect()
    a = engine.subscribe(conn, T, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    b = engine.subscribe(conn, T, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, T, b"p")
    deliveries = engine.poll(0.0)
    assert sorted(d.consumer_id for d in deliveries) == [a, b]
    assert ids(deliveries) == [sent, sent]
    # Each copy has its own delivery state.
    engine.nack(a, next(d.tag for d in deliveries if d.consumer_id == a))
    [again] = engine.poll(0.0)
    assert (again.consumer_id, again.delivery_count) == (a, 1)


def test_a_topic_without_subscriptions_drops(engine: Engine) -> None:
    assert engine.send(T, b"", persistent=True) is not None
    assert engine.drain_records() == []
    assert engine.queues() == []


def test_a_non_durable_subscription_ends_with_its_consumer(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, T)
    [name] = engine.queues()
    assert name == f"{T}::~{consumer}"
    engine.send(T, b"", persistent=True)
    assert engine.drain_records() == []  # not durable: nothing to write
    engine.close_consumer(consumer)
    assert engine.queues() == []


def test_a_durable_subscription_keeps_messages_without_consumers(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, T, subscription="c1.s")
    engine.close_consumer(consumer)
    sent = send(engine, T, b"", persistent=True, duplicate_id="d")
    sub = f"{T}::c1.s"
    assert engine.drain_records() == [
        QueueCreate(sub, T),
        MessageAdd((sub,), engine.browse(sub)[0], "d", NOW),
    ]
    again = engine.subscribe(engine.connect(), T, subscription="c1.s")
    assert ids(engine.poll(0.0)) == [sent]
    with pytest.raises(ResourceLockedError, match="active consumers"):
        engine.delete_subscription(T, "c1.s")
    engine.close_consumer(again)
    engine.delete_subscription(T, "c1.s")
    assert engine.drain_records()[-1] == QueueDelete(sub)
    with pytest.raises(UnknownAddressError):
        engine.delete_subscription(T, "c1.s")


def test_fan_out_to_durable_subscriptions_writes_the_body_once(engine: Engine) -> None:
    conn = engine.connect()
    engine.subscribe(conn, T, subscription="a")
    engine.subscribe(conn, T, subscription="b")
    engine.subscribe(conn, T)
    engine.drain_records()
    engine.send(T, b"", persistent=True)
    [record] = engine.drain_records()
    assert isinstance(record, MessageAdd)
    assert record.queues == (f"{T}::a", f"{T}::b")


def test_a_fully_qualified_name_reaches_one_subscription(engine: Engine) -> None:
    conn = engine.connect()
    a = engine.subscribe(conn, T, subscription="a")
    engine.subscribe(conn, T, subscription="b")
    engine.send(f"{T}::a", b"")
    assert [d.consumer_id for d in engine.poll(0.0)] == [a]


def test_a_private_subscription_cannot_be_joined(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, T)
    with pytest.raises(ResourceLockedError, match="private subscription"):
        engine.subscribe(conn, f"{T}::~{consumer}")


# --- temporary queues -------------------------------------------------------------------------


def test_a_temporary_queue_belongs_to_its_connection(engine: Engine) -> None:
    owner = engine.connect()
    other = engine.connect()
    name = engine.create_temp_queue(owner)
    assert name.startswith("temp-queue://broker-")
    engine.send(name, b"", persistent=True)
    assert engine.drain_records() == []  # temporary: never written
    with pytest.raises(ResourceLockedError, match="only be consumed by the connection"):
        engine.subscribe(other, name)
    with pytest.raises(ResourceLockedError, match="belongs to another connection"):
        engine.create_temp_queue(other, name)
    engine.subscribe(owner, name)
    assert len(engine.poll(0.0)) == 1
    engine.disconnect(owner)
    assert engine.queues() == []
    with pytest.raises(UnknownAddressError, match=f"address {name} does not exist"):
        engine.send(name, b"")


def test_held_temporary_queues_can_be_claimed_by_a_reconnecting_client(engine: Engine) -> None:
    owner = engine.connect()
    name = engine.create_temp_queue(owner, "temp-queue://client-1")
    engine.send(name, b"kept")
    assert engine.disconnect(owner, hold_temp_queues_until=30.0) == [name]
    engine.send(name, b"also kept")  # still addressable while held
    assert engine.tick(29.0) == []
    again = engine.connect()
    assert engine.create_temp_queue(again, name) == name
    engine.subscribe(again, name)
    assert [d.message.body for d in engine.poll(0.0)] == [b"kept", b"also kept"]
    assert engine.tick(31.0) == []  # claimed: no longer held
    assert engine.create_temp_queue(again, name) == name  # idempotent for its owner


def test_held_temporary_queues_go_when_the_hold_ends(engine: Engine) -> None:
    owner = engine.connect()
    name = engine.create_temp_queue(owner)
    engine.disconnect(owner, hold_temp_queues_until=30.0)
    assert engine.tick(30.0) == [name]
    assert engine.queues() == []


# --- transactions -----------------------------------------------------------------------------


def test_sends_in_a_transaction_wait_for_commit(engine: Engine) -> None:
    conn = engine.connect()
    tx = engine.begin(conn, "t1")
    assert engine.transaction_id(conn, "t1") == tx
    a = send(engine, Q, b"a", persistent=True, tx=tx)
    b = send(engine, Q, b"b", persistent=True, tx=tx, duplicate_id="d")
    engine.drain_records()
    assert engine.browse(Q) == []
    assert engine.commit(tx) == 0
    [ma, mb] = engine.browse(Q)
    assert (ma.id, mb.id) == (a, b)
    assert engine.drain_records() == [
        TxAdd(tx, (Q,), ma),
        TxAdd(tx, (Q,), mb, "d", NOW),
        TxCommit(tx),
    ]
    with pytest.raises(UnknownTransactionError, match="'t1'"):
        engine.transaction_id(conn, "t1")


def test_rollback_drops_sends_and_returns_acked_messages(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    first = send(engine, Q, b"", persistent=True)
    second = send(engine, Q, b"", persistent=True)
    deliveries = engine.poll(0.0)
    tx = engine.begin(conn)
    engine.ack(consumer, deliveries[1].tag, tx=tx)
    engine.ack(consumer, deliveries[0].tag, tx=tx)
    engine.send(Q, b"", tx=tx)
    engine.drain_records()
    engine.rollback(tx)
    again = engine.poll(0.0)
    assert ids(again) == [first, second]
    assert all(d.redelivered and d.delivery_count == 1 for d in again)
    assert engine.browse(Q) == []
    with pytest.raises(UnknownTransactionError):
        engine.commit(tx)


def test_acks_in_a_transaction_apply_at_commit(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT, window=2)
    sent = [send(engine, Q, b"", persistent=True) for _ in range(3)]
    deliveries = engine.poll(0.0)
    tx = engine.begin(conn)
    engine.ack(consumer, deliveries[1].tag, tx=tx)
    # The window reopens at once; the messages stay in flight until commit.
    assert ids(engine.poll(0.0)) == [sent[2]]
    assert engine.stats().in_flight == 3
    engine.drain_records()
    engine.commit(tx)
    assert engine.drain_records() == [TxAck(tx, Q, sent[0]), TxAck(tx, Q, sent[1]), TxCommit(tx)]
    assert engine.stats().in_flight == 1


def test_a_dropped_connection_aborts_its_transactions(engine: Engine) -> None:
    conn = engine.connect()
    other = engine.connect()
    consumer = engine.subscribe(other, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, Q, b"")
    tx = engine.begin(conn)
    engine.send(Q, b"", tx=tx)
    [d] = engine.poll(0.0)
    with pytest.raises(InvalidRequestError, match="different connections"):
        engine.ack(consumer, d.tag, tx=tx)
    engine.disconnect(conn)
    with pytest.raises(UnknownTransactionError):
        engine.commit(tx)
    with pytest.raises(UnknownConnectionError):
        engine.begin(conn)
    assert engine.ack(consumer, d.tag) == 1
    assert engine.browse(Q) == []
    assert sent is not None


def test_a_settlement_in_a_transaction_can_be_a_nack(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    sent = send(engine, Q, b"")
    tx = engine.begin(conn)
    engine.nack(consumer, engine.poll(0.0)[0].tag, tx=tx)
    assert engine.poll(0.0) == []
    engine.commit(tx)
    [again] = engine.poll(0.0)
    assert (again.message.id, again.delivery_count) == (sent, 1)


def test_an_empty_or_non_persistent_transaction_writes_nothing(engine: Engine) -> None:
    conn = engine.connect()
    engine.commit(engine.begin(conn))
    tx = engine.begin(conn)
    engine.send(Q, b"", tx=tx)
    engine.drain_records()
    engine.commit(tx)
    assert engine.drain_records() == []


def test_transaction_names_are_unique_per_connection(engine: Engine) -> None:
    a = engine.connect()
    b = engine.connect()
    engine.begin(a, "t")
    engine.begin(b, "t")
    with pytest.raises(InvalidRequestError, match="already open"):
        engine.begin(a, "t")


# --- duplicate detection ----------------------------------------------------------------------


def test_a_duplicate_is_dropped_but_accepted(engine: Engine) -> None:
    first = send(engine, Q, b"", persistent=True, duplicate_id="abc")
    assert engine.send(Q, b"", persistent=True, duplicate_id="abc") is None
    assert [m.id for m in engine.browse(Q)] == [first]
    assert engine.stats().duplicates_dropped == 1
    # The cache is per address.
    assert engine.send("queue://other", b"", persistent=True, duplicate_id="abc") is not None


def test_the_duplicate_cache_evicts_oldest_first() -> None:
    engine = Engine(EngineConfig(duplicate_cache_size=2, duplicate_id_retention=0))
    for d in ("a", "b", "c"):
        engine.send(Q, b"", persistent=True, duplicate_id=d)
    assert engine.persistent_state().duplicate_ids == {Q: ("b", "c")}
    assert engine.send(Q, b"", persistent=True, duplicate_id="a") is not None
    assert engine.send(Q, b"", persistent=True, duplicate_id="c") is None


def test_non_persistent_sends_are_checked_but_not_remembered(engine: Engine) -> None:
    engine.send(Q, b"", duplicate_id="n")
    assert engine.send(Q, b"", duplicate_id="n") is not None
    engine.send(Q, b"", persistent=True, duplicate_id="p")
    assert engine.send(Q, b"", duplicate_id="p") is None


def test_a_duplicate_id_without_a_durable_queue_is_written_alone(engine: Engine) -> None:
    engine.send(T, b"", persistent=True, duplicate_id="x")
    assert engine.drain_records() == [DuplicateId(T, "x", NOW)]
    assert engine.send(T, b"", persistent=True, duplicate_id="x") is None


def test_disabled_duplicate_detection() -> None:
    engine = Engine(EngineConfig(duplicate_cache_size=0))
    engine.send(Q, b"", persistent=True, duplicate_id="x")
    assert engine.send(Q, b"", persistent=True, duplicate_id="x") is not None
    assert all(r.duplicate_id is None for r in engine.drain_records() if isinstance(r, MessageAdd))


def test_a_duplicate_inside_a_transaction_is_dropped_at_commit(engine: Engine) -> None:
    conn = engine.connect()
    tx = engine.begin(conn)
    kept = send(engine, Q, b"", persistent=True, duplicate_id="x", tx=tx)
    engine.send(Q, b"", persistent=True, duplicate_id="x", tx=tx)
    # The id enters the cache only at commit.
    other = send(engine, Q, b"", persistent=True, duplicate_id="x")
    assert engine.commit(tx) == 2
    assert [m.id for m in engine.browse(Q)] == [other]
    assert kept != other


def test_retrying_a_committed_transaction_stores_nothing_twice(engine: Engine) -> None:
    conn = engine.connect()
    for attempt in range(2):
        tx = engine.begin(conn)
        first = engine.send(Q, b"1", persistent=True, duplicate_id="b1-1", tx=tx)
        second = engine.send(T, b"2", persistent=True, duplicate_id="b1-2", tx=tx)
        # On the retry both ids are already known: dropped at once, accepted all the same.
        assert (first is None, second is None) == (attempt == 1, attempt == 1)
        assert engine.commit(tx) == 0
    assert len(engine.browse(Q)) == 1
    assert engine.stats().duplicates_dropped == 2
    records = engine.drain_records()
    assert [type(r) for r in records] == [QueueCreate, TxAdd, TxDuplicateId, TxCommit]


# --- recovery ---------------------------------------------------------------------------------


def test_recovery_rebuilds_queues_messages_and_caches(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    engine.subscribe(conn, T, subscription="s")
    for i in range(6):
        engine.send(Q, b"%d" % i, persistent=True, priority=i % 3 + 3, duplicate_id=f"q{i}")
    engine.send(T, b"t", persistent=True, headers={"a": "b"}, expiration=99.0)
    engine.send(Q, b"lost", persistent=False)
    deliveries = [d for d in engine.poll(0.0) if d.consumer_id == consumer]
    engine.ack(consumer, deliveries[0].tag)
    engine.nack(consumer, deliveries[1].tag)
    records = engine.drain_records()
    backup = recovered(engine, records)
    assert backup.persistent_state() == engine.persistent_state()
    state = backup.persistent_state()
    assert set(state.queues) == {Q, f"{T}::s"}
    assert len(state.queues[Q].messages) == 5
    assert state.duplicate_ids[Q] == tuple(f"q{i}" for i in range(6))
    # Everything recovered may have been in flight: it comes back flagged.
    backup.subscribe(backup.connect(), Q, ack_mode=AckMode.CLIENT)
    assert all(d.redelivered for d in backup.poll(0.0))


def test_recovery_ignores_a_transaction_without_its_commit(engine: Engine) -> None:
    engine.send(Q, b"before", persistent=True)
    before = engine.persistent_state()
    conn = engine.connect()
    tx = engine.begin(conn)
    engine.send(Q, b"", persistent=True, tx=tx, duplicate_id="z")
    engine.send(T, b"", persistent=True, tx=tx, duplicate_id="y")
    engine.commit(tx)
    records = engine.drain_records()
    assert isinstance(records[-1], TxCommit)
    torn = Engine.recover(records[:-1])
    assert torn.persistent_state() == before
    assert Engine.recover(records).persistent_state() == engine.persistent_state()
    assert Engine.recover([*records[:-1], TxRollback(tx), TxCommit(tx)]).persistent_state() == (
        before
    )


def test_recovery_never_reuses_ids(engine: Engine) -> None:
    conn = engine.connect()
    engine.subscribe(conn, Q)
    engine.send(Q, b"", persistent=True)
    engine.send(Q, b"", persistent=True)
    engine.poll(0.0)  # auto ack: both gone
    tx = engine.begin(conn)
    engine.send(Q, b"", persistent=True, tx=tx)
    engine.commit(tx)
    records = engine.drain_records()
    backup = Engine.recover(records)
    assert backup.send(Q, b"") == 4
    assert backup.begin(backup.connect()) == 2
    # A checkpoint holds no message, but its watermark keeps the ids burnt.
    compacted = Engine.recover(engine.checkpoint())
    assert compacted.send(Q, b"") == 4
    assert Engine.recover([IdWatermark(100, 7)]).send(Q, b"") == 100


def test_checkpoint_rebuilds_the_same_state(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=2)
    engine.subscribe(conn, T, subscription="s", ack_mode=AckMode.CLIENT, window=3)
    for i in range(5):
        engine.send(Q, b"%d" % i, persistent=True, duplicate_id=f"d{i}", priority=i * 2)
        engine.send(T, b"%d" % i, persistent=True)
    deliveries = [d for d in engine.poll(0.0) if d.consumer_id == consumer]
    engine.nack(consumer, deliveries[0].tag)
    tx = engine.begin(conn)
    engine.ack(consumer, deliveries[1].tag, tx=tx)
    state = engine.persistent_state()
    assert Engine.recover(round_trip(engine.checkpoint())).persistent_state() == state
    assert recovered(engine, engine.drain_records()).persistent_state() == state


def test_recovery_skips_records_about_things_already_gone() -> None:
    records: list[Record] = [
        MessageAck(Q, 1),
        DeliveryCount(Q, 1, 3),
        DeadLetter(Q, 1, DLQ, 2),
        QueueDelete(Q),
        MessageAdd((Q,), Message(5, Q, b"", persistent=True)),
        TxAck(9, Q, 1),
        TxCommit(9),
        TxRollback(3),
    ]
    engine = Engine.recover(records)
    assert engine.queues() == []
    assert engine.send(Q, b"") == 6
    assert engine.begin(engine.connect()) == 10


# --- checkpoints ------------------------------------------------------------------------------


def _busy(engine: Engine) -> tuple[int, int]:
    """Queues with history: sends, acks, a nack, a dead letter, duplicate ids, a transaction;
    returns (connection, CLIENT_INDIVIDUAL consumer on Q)."""
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=3)
    engine.subscribe(conn, T, subscription="s", ack_mode=AckMode.CLIENT, window=1)
    for i in range(6):
        engine.send(Q, b"%d" % i, persistent=True, duplicate_id=f"d{i}", priority=i % 2 * 5)
        engine.send(T, b"t%d" % i, persistent=True)
        engine.send(Q, b"np", persistent=False)
    deliveries = [d for d in engine.poll(0.0) if d.consumer_id == consumer]
    engine.ack(consumer, deliveries[0].tag)
    engine.nack(consumer, deliveries[1].tag)
    engine.settle(consumer, deliveries[2].tag, Outcome.REJECTED)
    tx = engine.begin(conn)
    engine.send(Q, b"in tx", persistent=True, tx=tx)
    engine.commit(tx)
    return conn, consumer


def test_a_checkpoint_replaces_everything_before_it(engine: Engine) -> None:
    _, consumer = _busy(engine)
    before = engine.drain_records()
    checkpoint = list(engine.take_checkpoint().records())
    assert checkpoint[0] == CheckpointBegin(1)
    assert checkpoint[-1] == CheckpointEnd(1)
    assert checkpoint[1:-1] == engine.checkpoint()
    for delivery in engine.poll(0.0):
        if delivery.consumer_id == consumer:
            engine.ack(consumer, delivery.tag)
    engine.send(Q, b"after", persistent=True, duplicate_id="d9")
    after = engine.drain_records()
    state = engine.persistent_state()
    assert recovered(engine, before + checkpoint + after).persistent_state() == state
    # Compaction deletes whole segments: any cut at or before the BEGIN must do.
    for cut in range(len(before) + 1):
        journal = before[cut:] + checkpoint + after
        assert recovered(engine, journal).persistent_state() == state
    # Whatever came before the BEGIN is discarded, even records that contradict it.
    noise: list[Record] = [QueueDelete(Q), MessageAck(Q, 1), TxAdd(77, (Q,), Message(99, Q, b""))]
    assert recovered(engine, noise + checkpoint + after).persistent_state() == state
    assert recovered(engine, [*checkpoint, TxCommit(77), *after]).persistent_state() == state


def test_a_torn_checkpoint_is_ignored_until_the_next_one(engine: Engine) -> None:
    _busy(engine)
    before = engine.drain_records()
    state = engine.persistent_state()
    framed = list(engine.take_checkpoint().records())
    for cut in range(1, len(framed)):
        # The live died while writing the checkpoint: only a prefix reached the journal.
        backup = recovered(engine, before + framed[:cut])
        assert backup.persistent_state() == state
        assert backup.torn_checkpoint
        # The node writes a new checkpoint first; it supersedes the torn one.
        fresh = list(backup.take_checkpoint().records())
        assert not backup.torn_checkpoint
        assert fresh[0] == CheckpointBegin(2)
        backup.send(Q, b"later", persistent=True)
        journal = before + framed[:cut] + fresh + backup.drain_records()
        again = recovered(engine, journal)
        assert again.persistent_state() == backup.persistent_state()
        assert not again.torn_checkpoint
    assert not recovered(engine, before + framed).torn_checkpoint


def test_a_checkpoint_keeps_ids_and_duplicate_caches(engine: Engine) -> None:
    conn, _ = _busy(engine)
    engine.begin(conn)  # an open transaction burns its id
    engine.send(Q, b"", persistent=False)  # so does a message never journaled
    engine.drain_records()
    checkpoint = list(engine.take_checkpoint().records())
    backup = recovered(engine, checkpoint)
    assert backup.persistent_state().duplicate_ids == engine.persistent_state().duplicate_ids
    assert backup.send(Q, b"", persistent=True, duplicate_id="d3") is None
    assert backup.send(Q, b"") == engine.send(Q, b"")
    assert backup.begin(backup.connect()) == engine.begin(conn)
    assert backup.take_checkpoint().checkpoint_id == engine.take_checkpoint().checkpoint_id == 2


def test_a_checkpoint_between_a_transactions_operations(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    for i in range(3):
        engine.send(Q, b"%d" % i, persistent=True)
    deliveries = engine.poll(0.0)
    tx = engine.begin(conn)
    engine.ack(consumer, deliveries[0].tag, tx=tx)
    engine.send(Q, b"tx-1", persistent=True, tx=tx, duplicate_id="x")
    before = engine.drain_records()
    assert not any(isinstance(r, TxAdd | TxAck) for r in before)  # nothing written yet
    checkpoint = list(engine.take_checkpoint().records())
    engine.send(Q, b"tx-2", persistent=True, tx=tx)
    engine.ack(consumer, deliveries[1].tag, tx=tx)
    engine.commit(tx)
    after = engine.drain_records()
    state = engine.persistent_state()
    assert [m.message.body for m in state.queues[Q].messages] == [b"2", b"tx-1", b"tx-2"]
    assert recovered(engine, before + checkpoint + after).persistent_state() == state
    assert recovered(engine, checkpoint + after).persistent_state() == state
    # Torn after the commit's records but before its TX_COMMIT: the checkpoint stands alone.
    assert recovered(engine, checkpoint + after[:-1]).persistent_state() == (
        recovered(engine, checkpoint).persistent_state()
    )


def test_checkpoint_frames_that_do_not_match_are_skipped() -> None:
    add = MessageAdd((Q,), Message(5, Q, b"kept", persistent=True))
    stray: list[Record] = [QueueCreate(Q, Q), add, CheckpointEnd(4)]
    assert Engine.recover(stray).persistent_state().queues[Q].messages[0].message == add.message
    # An END for another id does not complete the open checkpoint.
    mismatched: list[Record] = [*stray, CheckpointBegin(6), QueueCreate("queue://x", "queue://x")]
    engine = Engine.recover([*mismatched, CheckpointEnd(5)])
    assert engine.torn_checkpoint
    assert engine.queues() == [Q]
    assert engine.take_checkpoint().checkpoint_id == 7


def test_take_checkpoint_wants_the_records_drained_first(engine: Engine) -> None:
    engine.send(Q, b"", persistent=True)
    with pytest.raises(InvalidRequestError, match="not drained"):
        engine.take_checkpoint()
    engine.drain_records()
    assert engine.take_checkpoint().checkpoint_id == 1


# --- errors and validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("orders", "must start with queue://, topic:// or temp-queue://"),
        ("queue://", "has no name after queue://"),
        ("queue://a::b", "'::', which is reserved"),
        ("queue://" + "x" * 20_000, "characters, over"),
    ],
)
def test_bad_addresses_are_refused_by_name(engine: Engine, address: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        engine.send(address, b"")


def test_bad_values_are_refused(engine: Engine) -> None:
    conn = engine.connect()
    with pytest.raises(InvalidRequestError, match="priority must be 0-9, not 10"):
        engine.send(Q, b"", priority=10)
    with pytest.raises(InvalidRequestError, match="NaN"):
        engine.send(Q, b"", expiration=float("nan"))
    with pytest.raises(InvalidRequestError, match="duplicate id"):
        engine.send(Q, b"", duplicate_id="d" * 20_000)
    with pytest.raises(InvalidRequestError, match="window"):
        engine.subscribe(conn, Q, window=0)
    with pytest.raises(InvalidRequestError, match="credit"):
        engine.subscribe(conn, Q, credit=-1)
    with pytest.raises(InvalidRequestError, match="topic://"):
        engine.subscribe(conn, Q, subscription="s")
    with pytest.raises(InvalidRequestError, match="subscription name"):
        engine.subscribe(conn, T, subscription="~x")
    with pytest.raises(InvalidRequestError, match="must start with queue://"):
        engine.create_queue(T)
    with pytest.raises(InvalidRequestError, match="must start with temp-queue://"):
        engine.create_temp_queue(conn, Q)
    with pytest.raises(UnknownAddressError):
        engine.subscribe(conn, "temp-queue://nope")
    with pytest.raises(UnknownAddressError):
        engine.browse("queue://nope")


def test_queues_are_not_created_when_auto_create_is_off() -> None:
    engine = Engine(EngineConfig(auto_create_queues=False))
    with pytest.raises(UnknownAddressError, match="does not exist"):
        engine.send(Q, b"")
    with pytest.raises(UnknownAddressError):
        engine.subscribe(engine.connect(), Q)
    engine.create_queue(Q)
    engine.create_queue(Q)
    assert engine.drain_records() == [QueueCreate(Q, Q)]
    engine.send(Q, b"")


@pytest.mark.parametrize(
    "settings_",
    [
        {"max_delivery_attempts": 0},
        {"dead_letter_queue": "topic://dlq"},
        {"duplicate_cache_size": -1},
        {"node_id": ""},
        {"first_message_id": -1},
    ],
)
def test_bad_configuration_is_refused(settings_: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        EngineConfig(**settings_)


def test_errors_share_one_root_and_a_builtin() -> None:
    for error in (
        UnknownAddressError,
        UnknownConnectionError,
        UnknownConsumerError,
        UnknownDeliveryError,
        UnknownTransactionError,
    ):
        assert issubclass(error, NotFoundError)
        assert issubclass(error, LookupError)
        assert issubclass(error, BrokerError)
    assert issubclass(InvalidRequestError, ValueError)
    assert issubclass(ResourceLockedError, PermissionError)
    assert UnknownDeliveryError.code == "DELIVERY_NOT_FOUND"


def test_deleting_a_queue_closes_its_consumers(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT)
    engine.send(Q, b"", persistent=True)
    engine.poll(0.0)
    engine.drain_records()
    assert engine.delete_queue(Q) == [consumer]
    assert engine.drain_records() == [QueueDelete(Q)]
    with pytest.raises(UnknownConsumerError):
        engine.close_consumer(consumer)
    assert engine.stats().consumers == 0


def test_stats_count_what_the_status_page_shows(engine: Engine) -> None:
    conn = engine.connect()
    consumer = engine.subscribe(conn, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL, window=1)
    for _ in range(3):
        engine.send(Q, b"")
    engine.send(Q, b"", duplicate_id="x", persistent=True)
    engine.send(Q, b"", duplicate_id="x", persistent=True)
    [d] = engine.poll(0.0)
    engine.begin(conn)
    stats = engine.stats()
    assert (stats.connections, stats.consumers, stats.transactions) == (1, 1, 1)
    assert (stats.messages, stats.in_flight, stats.duplicates_dropped) == (3, 1, 1)
    [queue] = stats.queues
    assert (queue.name, queue.durable, queue.temporary, queue.consumers) == (Q, True, False, 1)
    assert (queue.enqueued, queue.acknowledged) == (4, 0)
    engine.ack(consumer, d.tag)
    assert engine.stats().queues[0].acknowledged == 1


# --- the stateful model test ------------------------------------------------------------------

MAX_ATTEMPTS = 2
CACHE = 3
DURABLE_SUB = "topic://t::s"
SEND_ADDRESSES = ("queue://a",) * 4 + ("queue://b", "topic://t", "topic://t", DURABLE_SUB, DLQ)
SUBSCRIBE_ADDRESSES = ("queue://a",) * 3 + ("queue://b", "topic://t", "topic://t", DLQ)


class MEntry:
    """The model's view of one message in one queue."""

    def __init__(
        self,
        message_id: int,
        priority: int,
        seq: int,
        persistent: bool,
        expiration: float | None,
        body: bytes,
    ) -> None:
        self.id = message_id
        self.priority = priority
        self.seq = seq
        self.persistent = persistent
        self.expiration = expiration
        self.body = body
        self.count = 0
        self.redelivered = False

    def key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


class MQueue:
    def __init__(
        self, name: str, address: str, durable: bool, owner: int | None, subscriber: int | None
    ) -> None:
        self.name = name
        self.address = address
        self.durable = durable
        self.temporary = name.startswith("temp-queue://")
        self.owner = owner
        self.subscriber = subscriber
        self.hold_until: float | None = None
        self.ready: list[MEntry] = []
        self.deleted = False
        self.incarnation = next(MQueue.incarnations)

    incarnations = itertools.count()

    def sort(self) -> None:
        self.ready.sort(key=MEntry.key)


class MConsumer:
    def __init__(
        self,
        cid: int,
        conn: int,
        queue: MQueue,
        mode: AckMode,
        window: int | None,
        credit: int | None,
    ) -> None:
        self.id = cid
        self.conn = conn
        self.queue = queue
        self.mode = mode
        self.window = window
        self.credit = credit
        self.unacked: dict[int, MEntry] = {}

    def has_room(self) -> bool:
        return (self.credit is None or self.credit > 0) and (
            self.window is None or len(self.unacked) < self.window
        )


class MTx:
    def __init__(self, tx: int, conn: int) -> None:
        self.id = tx
        self.conn = conn
        self.sends: list[tuple[MEntry, list[MQueue], str | None, str]] = []
        self.settles: list[tuple[MQueue, MEntry, Outcome]] = []


@settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
class EngineMachine(RuleBasedStateMachine):
    """The engine against a model that re-states each rule in the plainest way: lists that are
    sorted, entries that are moved between them. After every step: the engine's queues hold
    the model's messages in the model's order, nothing is in flight twice, every message is
    accounted for, and recovery from the records (encoded and decoded) rebuilds the engine's
    persistent state."""

    @initialize()
    def start(self) -> None:
        # Retention 0: the cache is bounded by its count alone, as the model is.
        self.config = EngineConfig(
            max_delivery_attempts=MAX_ATTEMPTS, duplicate_cache_size=CACHE, duplicate_id_retention=0
        )
        self.engine = Engine(self.config)
        self.journal: list[tuple[int, bytes]] = []
        self.now = 0.0
        self.next_id = 1
        self.seq = itertools.count()
        self.queues: dict[str, MQueue] = {}
        self.consumers: dict[int, MConsumer] = {}
        self.connections: dict[int, list[int]] = {}  # connection -> its open transactions
        self.txs: dict[int, MTx] = {}
        self.caches: dict[str, list[str]] = {}
        self.temp_names: list[str] = []
        for _ in range(2):
            self.connections[self.engine.connect()] = []
        # the ledger: where every message that entered a queue ended
        self.finished: set[tuple[str, int, int]] = set()  # (queue, incarnation, id)
        self.entered: set[tuple[str, int, int]] = set()

    # --- model helpers ---

    def _create(
        self,
        name: str,
        address: str,
        durable: bool,
        owner: int | None = None,
        subscriber: int | None = None,
    ) -> MQueue:
        queue = MQueue(name, address, durable, owner, subscriber)
        self.queues[name] = queue
        return queue

    def _delete(self, queue: MQueue) -> None:
        queue.deleted = True
        del self.queues[queue.name]
        for consumer in [c for c in self.consumers.values() if c.queue is queue]:
            del self.consumers[consumer.id]

    def _ledger(self, queue: MQueue, entry: MEntry) -> tuple[str, int, int]:
        return (queue.name, queue.incarnation, entry.id)

    def _enqueue(self, queue: MQueue, entry: MEntry) -> None:
        queue.ready.append(entry)
        queue.sort()
        self.entered.add(self._ledger(queue, entry))

    def _finished(self, queue: MQueue, entry: MEntry) -> None:
        key = self._ledger(queue, entry)
        assert key not in self.finished
        self.finished.add(key)

    def _targets(self, address: str) -> list[MQueue]:
        if address in self.queues:
            return [self.queues[address]]
        if address.startswith("topic://"):
            return [q for q in self.queues.values() if q.address == address and q.name != address]
        return [self._create(address, address, True)]

    def _new_entry(self, message_id: int, entry: MEntry) -> MEntry:
        return MEntry(
            message_id,
            entry.priority,
            next(self.seq),
            entry.persistent,
            entry.expiration,
            entry.body,
        )

    def _route(self, proto: MEntry, targets: list[MQueue], dup: str | None, address: str) -> None:
        for queue in targets:
            self._enqueue(queue, self._new_entry(proto.id, proto))
        if proto.persistent and dup is not None:
            cache = self.caches.setdefault(address, [])
            if dup not in cache:
                cache.append(dup)
                del cache[:-CACHE]

    def _is_duplicate(self, address: str, dup: str | None) -> bool:
        return dup is not None and dup in self.caches.get(address, [])

    def _dead_letter(self, queue: MQueue, entry: MEntry) -> None:
        event("dead-lettered")
        self._finished(queue, entry)
        dlq = self.queues.get(DLQ) or self._create(DLQ, DLQ, True)
        copy = MEntry(
            self.next_id, entry.priority, next(self.seq), entry.persistent, None, entry.body
        )
        self.next_id += 1
        self._enqueue(dlq, copy)

    def _finish(self, queue: MQueue, entries: list[MEntry], outcome: Outcome) -> None:
        if outcome is Outcome.ACCEPTED:
            for entry in entries:
                self._finished(queue, entry)
            return
        is_dlq = queue.name == DLQ
        if outcome is Outcome.REJECTED and not is_dlq:
            for entry in entries:
                self._dead_letter(queue, entry)
            return
        for entry in entries:
            entry.redelivered = True
            if outcome is not Outcome.RELEASED:
                entry.count += 1
                if entry.count >= MAX_ATTEMPTS and not is_dlq:
                    self._dead_letter(queue, entry)
                    continue
            queue.ready.append(entry)
        queue.sort()

    def _drop_queue_contents(self, queue: MQueue) -> None:
        for entry in queue.ready:
            self._finished(queue, entry)
        for consumer in self.consumers.values():
            if consumer.queue is queue:
                for entry in consumer.unacked.values():
                    self._finished(queue, entry)
        for tx in self.txs.values():
            for q, entry, _ in tx.settles:
                if q is queue:
                    self._finished(queue, entry)

    def _close_consumer(self, consumer: MConsumer) -> None:
        del self.consumers[consumer.id]
        entries = list(consumer.unacked.values())
        if consumer.queue.subscriber == consumer.id:
            for entry in consumer.queue.ready + entries:
                self._finished(consumer.queue, entry)
            for tx in self.txs.values():
                for q, entry, _ in tx.settles:
                    if q is consumer.queue:
                        self._finished(q, entry)
            self._delete(consumer.queue)
        elif entries:
            self._finish(consumer.queue, entries, Outcome.FAILED)

    def _rollback(self, tx: MTx) -> None:
        by_queue: dict[int, tuple[MQueue, list[MEntry]]] = {}
        for queue, entry, _ in tx.settles:
            if not queue.deleted:
                by_queue.setdefault(id(queue), (queue, []))[1].append(entry)
        for queue, entries in by_queue.values():
            self._finish(queue, entries, Outcome.FAILED)

    def _end_tx(self, tx: MTx) -> None:
        del self.txs[tx.id]
        self.connections[tx.conn].remove(tx.id)

    def _drain(self) -> None:
        for record in self.engine.drain_records():
            if isinstance(record, MessageAdd | TxAdd):
                assert record.message.persistent, "a non-persistent message was written"
            self.journal.append(record.encode())

    # --- rules ---

    def _connect(self) -> None:
        self.connections[self.engine.connect()] = []

    def _disconnect(self, data: st.DataObject) -> None:
        hold = data.draw(st.booleans())
        conn = data.draw(st.sampled_from(sorted(self.connections)))
        self.engine.disconnect(conn, hold_temp_queues_until=self.now + 5 if hold else None)
        for tx_id in list(self.connections[conn]):
            tx = self.txs[tx_id]
            self._end_tx(tx)
            self._rollback(tx)
        for consumer in [c for c in self.consumers.values() if c.conn == conn]:
            self._close_consumer(consumer)
        for queue in [q for q in self.queues.values() if q.temporary and q.owner == conn]:
            if hold:
                queue.owner = None
                queue.hold_until = self.now + 5
            else:
                self._drop_queue_contents(queue)
                self._delete(queue)
        del self.connections[conn]
        self._drain()

    def _create_temp_queue(self, data: st.DataObject) -> None:
        claim = data.draw(st.booleans())
        conn = data.draw(st.sampled_from(sorted(self.connections)))
        held = [q for q in self.queues.values() if q.temporary and q.owner is None]
        if claim and held:
            queue = data.draw(st.sampled_from(held))
            assert self.engine.create_temp_queue(conn, queue.name) == queue.name
            queue.owner = conn
            queue.hold_until = None
        else:
            name = self.engine.create_temp_queue(conn)
            assert name not in self.queues
            self._create(name, name, False, owner=conn)
            self.temp_names.append(name)

    def _close_consumer_rule(self, data: st.DataObject) -> None:
        consumer = self.consumers[data.draw(st.sampled_from(sorted(self.consumers)))]
        self.engine.close_consumer(consumer.id)
        self._close_consumer(consumer)
        self._drain()

    def _add_credit(self, data: st.DataObject) -> None:
        credit = data.draw(st.integers(min_value=0, max_value=3))
        consumer = self.consumers[data.draw(st.sampled_from(sorted(self.consumers)))]
        self.engine.add_credit(consumer.id, credit)
        if consumer.credit is not None:
            consumer.credit += credit

    def _delete_subscription(self) -> None:
        queue = self.queues[DURABLE_SUB]
        if any(c.queue is queue for c in self.consumers.values()):
            with pytest.raises(ResourceLockedError):
                self.engine.delete_subscription("topic://t", "s")
            return
        self.engine.delete_subscription("topic://t", "s")
        self._drop_queue_contents(queue)
        self._delete(queue)
        self._drain()

    def _begin(self, data: st.DataObject) -> None:
        self._begin_on(data.draw(st.sampled_from(sorted(self.connections))))

    def _begin_on(self, conn: int) -> int:
        tx = self.engine.begin(conn)
        self.txs[tx] = MTx(tx, conn)
        self.connections[conn].append(tx)
        return tx

    def _end_transaction(self, data: st.DataObject, commit: bool) -> None:
        tx = self.txs[data.draw(st.sampled_from(sorted(self.txs)))]
        self._end_tx(tx)
        if not commit:
            self.engine.rollback(tx.id)
            self._rollback(tx)
            self._drain()
            return
        dropped = self.engine.commit(tx.id)
        expected = 0
        for proto, targets, dup, address in tx.sends:
            if self._is_duplicate(address, dup):
                event("commit dropped a duplicate")
                expected += 1
                continue
            self._route(proto, [q for q in targets if not q.deleted], dup, address)
        later = []
        for queue, entry, outcome in tx.settles:
            if queue.deleted:
                continue
            if outcome is Outcome.ACCEPTED:
                self._finished(queue, entry)
            else:
                later.append((queue, entry, outcome))
        for queue, entry, outcome in later:
            self._finish(queue, [entry], outcome)
        assert dropped == expected
        self._drain()
        if any(isinstance(decode(t, p), TxCommit) for t, p in self.journal[-1:]):
            event("commit wrote a transaction")

    @rule(
        data=st.data(),
        action=st.sampled_from(
            [
                "connect",
                "disconnect",
                "temp queue",
                "close consumer",
                "add credit",
                "delete subscription",
            ]
        ),
    )
    def connection_event(self, data: st.DataObject, action: str) -> None:
        """Everything about connections and consumers but subscribing, as one rule: fewer
        rules let swarm testing enable the core ones (send, subscribe, settle) together."""
        if action == "connect" and len(self.connections) < 3:
            self._connect()
        elif action == "disconnect" and self.connections:
            self._disconnect(data)
        elif action == "temp queue" and self.connections:
            self._create_temp_queue(data)
        elif action == "close consumer" and self.consumers:
            self._close_consumer_rule(data)
        elif action == "add credit" and self.consumers:
            self._add_credit(data)
        elif action == "delete subscription" and DURABLE_SUB in self.queues:
            self._delete_subscription()

    @rule(data=st.data(), action=st.sampled_from(["begin", "commit", "rollback"]))
    def transaction(self, data: st.DataObject, action: str) -> None:
        if action == "begin" and self.connections:
            self._begin(data)
        elif action != "begin" and self.txs:
            self._end_transaction(data, commit=action == "commit")

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]), sweep=st.booleans())
    def advance_time(self, dt: float, sweep: bool) -> None:
        self.now += dt
        deleted = self.engine.tick(self.now)
        expected = [
            q
            for q in self.queues.values()
            if q.temporary and q.hold_until is not None and q.hold_until <= self.now
        ]
        assert sorted(deleted) == sorted(q.name for q in expected)
        for queue in expected:
            self._drop_queue_contents(queue)
            self._delete(queue)
        if sweep:
            self._expire()

    def _expire(self) -> None:
        dropped = self.engine.expire(self.now)
        count = 0
        for queue in self.queues.values():
            keep = []
            for entry in queue.ready:
                if entry.expiration is not None and entry.expiration <= self.now:
                    self._finished(queue, entry)
                    count += 1
                else:
                    keep.append(entry)
            queue.ready = keep
        assert dropped == count
        if count:
            event("expired by the sweep")
        self._drain()

    @rule(
        data=st.data(),
        persistent=st.booleans(),
        priority=st.sampled_from([0, 4, 4, 4, 9]),
        dup=st.none() | st.sampled_from(["d1", "d2", "d3", "d4", "d5"]),
        ttl=st.none() | st.sampled_from([0.5, 2.0]),
        in_tx=st.booleans(),
        then_poll=st.booleans(),
        burst=st.integers(min_value=1, max_value=3),
    )
    def send(
        self,
        data: st.DataObject,
        persistent: bool,
        priority: int,
        dup: str | None,
        ttl: float | None,
        in_tx: bool,
        then_poll: bool,
        burst: int,
    ) -> None:
        # Weighted toward one queue, so that sends meet consumers often.
        address = data.draw(st.sampled_from([*SEND_ADDRESSES, *self.temp_names[-3:]]))
        tx = None
        if in_tx and self.txs:
            tx = data.draw(st.sampled_from(sorted(self.txs)))
        elif in_tx and self.connections:
            tx = self._begin_on(data.draw(st.sampled_from(sorted(self.connections))))
        expiration = None if ttl is None else self.now + ttl
        if address not in self.queues and address.startswith(("temp-queue://", "topic://t::")):
            with pytest.raises(UnknownAddressError if "temp" in address else InvalidRequestError):
                self.engine.send(address, b"", persistent=persistent, tx=tx)
            return
        # A burst builds queues deep enough for requeue order and windows to matter; only the
        # first message carries the duplicate id.
        for i in range(burst):
            self._send_one(address, persistent, priority, dup if i == 0 else None, expiration, tx)
        self._drain()
        if then_poll:
            self._poll()

    def _send_one(
        self,
        address: str,
        persistent: bool,
        priority: int,
        dup: str | None,
        expiration: float | None,
        tx: int | None,
    ) -> None:
        body = b"m%d" % self.next_id
        result = self.engine.send(
            address,
            body,
            persistent=persistent,
            priority=priority,
            expiration=expiration,
            duplicate_id=dup,
            tx=tx,
        )
        targets = self._targets(address)
        if self._is_duplicate(address, dup):
            event("send dropped as duplicate")
            assert result is None
            return
        assert result == self.next_id
        self.next_id += 1
        proto = MEntry(result, priority, -1, persistent, expiration, body)
        if tx is None:
            self._route(proto, targets, dup, address)
        else:
            self.txs[tx].sends.append((proto, targets, dup, address))

    @precondition(lambda self: self.connections)
    @rule(
        data=st.data(),
        mode=st.sampled_from(AckMode),
        window=st.sampled_from([None, 1, 2]),
        credit=st.sampled_from([None, None, None, 0, 2]),
        durable=st.booleans(),
    )
    def subscribe(
        self,
        data: st.DataObject,
        mode: AckMode,
        window: int | None,
        credit: int | None,
        durable: bool,
    ) -> None:
        conn = data.draw(st.sampled_from(sorted(self.connections)))
        own_temps = [q.name for q in self.queues.values() if q.temporary and q.owner == conn]
        address = data.draw(st.sampled_from([*SUBSCRIBE_ADDRESSES, *own_temps]))
        subscription = "s" if durable and address == "topic://t" else None
        cid = self.engine.subscribe(
            conn, address, ack_mode=mode, window=window, credit=credit, subscription=subscription
        )
        if subscription is not None:
            queue = self.queues.get(DURABLE_SUB) or self._create(DURABLE_SUB, address, True)
        elif address == "topic://t":
            queue = self._create(f"topic://t::~{cid}", address, False, subscriber=cid)
        else:
            queue = self.queues.get(address) or self._create(address, address, True)
        self.consumers[cid] = MConsumer(cid, conn, queue, mode, window, credit)
        self._drain()
        self._poll()

    @rule()
    def poll(self) -> None:
        self._poll()

    def _poll(self) -> None:
        deliveries = self.engine.poll(self.now)
        in_flight = {
            (c.queue.name, e.id) for c in self.consumers.values() for e in c.unacked.values()
        }
        if deliveries:
            event("poll delivered")
        if any(d.redelivered for d in deliveries):
            event("poll redelivered")
        for delivery in deliveries:
            consumer = self.consumers[delivery.consumer_id]
            queue = consumer.queue
            assert consumer.has_room(), "delivered to a consumer without credit or window"
            # Whatever the engine skipped at the head must have expired.
            while queue.ready and (
                queue.ready[0].expiration is not None and queue.ready[0].expiration <= self.now
            ):
                self._finished(queue, queue.ready.pop(0))
            assert queue.ready, f"{queue.name} delivered a message the model does not have"
            head = queue.ready.pop(0)
            assert delivery.message.id == head.id, "not the head of the queue"
            assert (queue.name, head.id) not in in_flight, "delivered twice at once"
            assert delivery.message.body == head.body
            assert delivery.delivery_count == head.count
            assert delivery.redelivered == head.redelivered
            if consumer.credit is not None:
                consumer.credit -= 1
            if consumer.mode is AckMode.AUTO:
                self._finished(queue, head)
            else:
                consumer.unacked[delivery.tag] = head
                in_flight.add((queue.name, head.id))
        for queue in self.queues.values():
            if any(c.has_room() for c in self.consumers.values() if c.queue is queue):
                # The engine tried for more and found only expired messages, or nothing.
                for entry in queue.ready:
                    assert entry.expiration is not None, f"{queue.name} left a message behind"
                    assert entry.expiration <= self.now, f"{queue.name} left a message behind"
                    self._finished(queue, entry)
                queue.ready = []
        self._drain()

    @precondition(lambda self: any(c.unacked for c in self.consumers.values()))
    @rule(
        data=st.data(),
        outcome=st.sampled_from([Outcome.ACCEPTED, *Outcome]),
        in_tx=st.booleans(),
        then_poll=st.booleans(),
    )
    def settle(self, data: st.DataObject, outcome: Outcome, in_tx: bool, then_poll: bool) -> None:
        consumer = self.consumers[
            data.draw(st.sampled_from(sorted(c.id for c in self.consumers.values() if c.unacked)))
        ]
        tag = data.draw(st.sampled_from(sorted(consumer.unacked)))
        own = [t for t in self.connections[consumer.conn] if t in self.txs]
        tx = None
        if in_tx:
            tx = data.draw(st.sampled_from(own)) if own else self._begin_on(consumer.conn)
            event("settled in a transaction")
        # The shortcuts are what the protocol layers call; the rest goes through settle().
        if outcome is Outcome.ACCEPTED:
            settled = self.engine.ack(consumer.id, tag, tx=tx)
        elif outcome is Outcome.FAILED:
            settled = self.engine.nack(consumer.id, tag, tx=tx)
        else:
            settled = self.engine.settle(consumer.id, tag, outcome, tx=tx)
        if consumer.mode is AckMode.CLIENT:
            tags = [t for t in consumer.unacked if t <= tag]
        else:
            tags = [tag]
        assert settled == len(tags)
        entries = [consumer.unacked.pop(t) for t in tags]
        if tx is not None:
            self.txs[tx].settles.extend((consumer.queue, e, outcome) for e in entries)
        else:
            self._finish(consumer.queue, entries, outcome)
        self._drain()
        if then_poll:
            self._poll()

    @rule(roll=st.integers(min_value=0, max_value=3))
    def checkpoint(self, roll: int) -> None:
        """The live checkpoints into its journal, wherever the other rules left things
        (open transactions, messages in flight)."""
        if roll:
            return  # one draw in four at most, as for crashes
        self._drain()
        self.journal.extend(self.engine.take_checkpoint().encode())
        event("checkpoint")

    def _last_begin(self) -> int | None:
        begins = [i for i, (t, _) in enumerate(self.journal) if t == RecordType.CHECKPOINT_BEGIN]
        return begins[-1] if begins else None

    @precondition(lambda self: self.journal)
    @rule(roll=st.integers(min_value=0, max_value=3), data=st.data())
    def crash_and_recover(self, roll: int, data: st.DataObject) -> None:
        """The live dies (maybe while writing a checkpoint, maybe after its journal was
        compacted); a backup recovers from the journal and carries on."""
        if roll:
            return  # a crash on every fourth draw at most: the rest of the rules need time
        compact = self._last_begin()
        if compact is not None and data.draw(st.booleans()):
            # Compaction deleted whole segments: the journal starts anywhere up to the BEGIN.
            del self.journal[: data.draw(st.integers(min_value=0, max_value=compact))]
            event("crash after compaction")
        torn = data.draw(st.booleans())
        if torn:
            self._drain()
            framed = self.engine.take_checkpoint().encode()
            self.journal.extend(framed[: data.draw(st.integers(1, len(framed) - 1))])
            event("crash in a checkpoint")
        records = [decode(t, p) for t, p in self.journal]
        before = self.engine.persistent_state()
        if any(q.messages for q in before.queues.values()):
            event("crash with messages stored")
        self.engine = Engine.recover(records, self.config)
        assert self.engine.persistent_state() == before
        assert self.engine.torn_checkpoint == torn
        if torn:
            # As the node does before serving: what follows a torn checkpoint would be read
            # as part of it, so a new checkpoint goes first.
            self.journal.extend(self.engine.take_checkpoint().encode())
        survivors: dict[str, list[MEntry]] = {}
        for queue in list(self.queues.values()):
            entries = self._stored(queue)
            self._drop_queue_contents(queue)
            self._delete(queue)
            if queue.durable:
                survivors[queue.name] = [e for e in entries if e.persistent]
        self.consumers.clear()
        self.txs.clear()
        self.connections = {self.engine.connect(): [] for _ in range(2)}  # clients fail over
        for name, entries in survivors.items():
            address = "topic://t" if name == DURABLE_SUB else name
            queue = self._create(name, address, True)
            for entry in entries:
                entry.redelivered = True
                self._enqueue(queue, entry)
        seen = [0]
        for record in records:
            if isinstance(record, MessageAdd | TxAdd):
                seen.append(record.message.id)
            elif isinstance(record, DeadLetter):
                seen.append(record.new_message_id)
            elif isinstance(record, IdWatermark):
                seen.append(record.next_message_id - 1)
        self.next_id = max(seen) + 1

    # --- invariants ---

    def _stored(self, queue: MQueue) -> list[MEntry]:
        entries = list(queue.ready)
        for consumer in self.consumers.values():
            if consumer.queue is queue:
                entries.extend(consumer.unacked.values())
        for tx in self.txs.values():
            entries.extend(e for q, e, _ in tx.settles if q is queue)
        return sorted(entries, key=MEntry.key)

    @invariant()
    def queues_hold_the_model_messages_in_order(self) -> None:
        if not hasattr(self, "engine"):
            return
        assert sorted(self.engine.queues()) == sorted(self.queues)
        stats = {q.name: q for q in self.engine.stats().queues}
        for name, queue in self.queues.items():
            assert [m.id for m in self.engine.browse(name)] == [e.id for e in queue.ready]
            in_flight = len(self._stored(queue)) - len(queue.ready)
            assert (stats[name].messages, stats[name].in_flight) == (len(queue.ready), in_flight)
        for cid, consumer in self.consumers.items():
            info = self.engine.consumer_info(cid)
            assert (info.unacked, info.credit) == (len(consumer.unacked), consumer.credit)

    @invariant()
    def each_address_counts_what_its_queues_and_open_transactions_hold(self) -> None:
        """Against --max-address-bytes/-messages: a message counts from its send (in a
        transaction too) until it is acknowledged, dead-lettered, expired or deleted."""
        if not hasattr(self, "engine"):
            return
        expected: dict[str, list[int]] = {q.address: [0, 0] for q in self.queues.values()}
        held = [(q, e) for q in self.queues.values() for e in self._stored(q)]
        held += [(q, e) for tx in self.txs.values() for e, qs, _, _ in tx.sends for q in qs]
        for queue, entry in held:
            counted = expected.setdefault(queue.address, [0, 0])
            counted[0] += 1
            counted[1] += len(entry.body) + MESSAGE_OVERHEAD
        for address, (messages, size) in expected.items():
            usage = self.engine.address_usage(address)
            assert usage[0] == messages, (address, usage, messages)
            if address != DLQ:  # a dead-lettered copy carries headers the model does not
                assert usage[1] == size, (address, usage, size)

    @invariant()
    def every_message_is_somewhere_or_finished(self) -> None:
        if not hasattr(self, "engine"):
            return
        live = [self._ledger(q, e) for q in self.queues.values() for e in self._stored(q)]
        assert len(live) == len(set(live)), "a message is in two places"
        assert set(live).isdisjoint(self.finished)
        assert set(live) | self.finished == self.entered, "a message was lost"

    @invariant()
    def persistent_state_matches_the_model_and_recovery(self) -> None:
        if not hasattr(self, "engine"):
            return
        state = self.engine.persistent_state()
        expected = {
            name: [(e.id, e.count) for e in self._stored(q) if e.persistent]
            for name, q in self.queues.items()
            if q.durable
        }
        actual = {
            name: [(m.message.id, m.delivery_count) for m in q.messages]
            for name, q in state.queues.items()
        }
        assert actual == expected
        assert dict(state.duplicate_ids) == {a: tuple(c) for a, c in self.caches.items() if c}
        records = [decode(t, p) for t, p in self.journal]
        assert Engine.recover(records, self.config).persistent_state() == state
        checkpoint = [decode(*r.encode()) for r in self.engine.checkpoint()]
        assert Engine.recover(checkpoint, self.config).persistent_state() == state
        # What compaction keeps, from the last complete CHECKPOINT_BEGIN on, is enough.
        begin = self._last_begin()
        if begin is not None:
            suffix = Engine.recover(records[begin:], self.config)
            assert suffix.persistent_state() == state
            assert not suffix.torn_checkpoint
        # A checkpoint torn at the tail changes nothing.
        torn = [*records, CheckpointBegin(2**40), *checkpoint[: len(checkpoint) // 2 + 1]]
        recovered_torn = Engine.recover(torn, self.config)
        assert recovered_torn.persistent_state() == state
        assert recovered_torn.torn_checkpoint


TestEngineMachine = EngineMachine.TestCase


def test_one_poll_hands_an_auto_ack_consumer_a_bounded_share_of_a_backlog() -> None:
    """Without a window to stop it, an auto-acknowledging consumer would take a whole queue
    into memory (and its connection's write buffer) in one turn; the rest waits for the next."""
    engine = Engine(EngineConfig(dispatch_per_poll=1000))
    conn = engine.connect()
    for i in range(5000):
        engine.send("queue://backlog", b"%d" % i, persistent=True)
    engine.subscribe(conn, "queue://backlog", ack_mode=AckMode.AUTO)
    batches = []
    while True:
        batch = engine.poll(0.0)
        if not batch:
            break
        batches.append(len(batch))
        assert engine.dispatch_pending == (sum(batches) < 5000)
    assert batches == [1000] * 5
    assert not engine.dispatch_pending
