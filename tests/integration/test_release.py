"""Message.release() on the bundled pair, both protocols: a CLIENT_INDIVIDUAL consumer gives
one message back alone (STOMP NACK, AMQP modified with delivery-failed); the broker raises its
delivery count and delivers it again. Across a failover a release of a message delivered
before it is stale, like an acknowledge (F8), and max_redeliveries counts every release, the
stale one too, so a message released each time lands in the dead-letter queue after
max_redeliveries + 1 deliveries."""

from __future__ import annotations

import time
import uuid

import pytest

import hafailover
from hafailover import AckMode, IllegalStateError, Message, StaleAcknowledgeError
from reference_broker import BrokerPair

from .support import STEADY_HEARTBEAT, drain, url_for, wait_until

pytestmark = pytest.mark.timeout(120)


def test_release_gives_one_message_back_alone(pair: BrokerPair, protocol: str) -> None:
    queue = f"queue://release-{uuid.uuid4().hex[:8]}"
    with hafailover.connect(url_for(pair, protocol)) as connection:
        session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        producer = session.create_producer(queue)
        for seq in range(3):
            producer.send(Message(body=f"m{seq}", properties={"seq": seq}))
        consumer = session.create_consumer(queue, prefetch=10)
        connection.start()
        first = [consumer.receive(10) for _ in range(3)]
        assert all(m is not None for m in first)
        held = {int(str(m.properties["seq"])): m for m in first if m is not None}
        assert sorted(held) == [0, 1, 2]
        assert held[1].delivery_count == 0
        held[1].release()
        held[0].acknowledge()
        held[2].acknowledge()
        again = consumer.receive(10)
        assert again is not None
        assert int(str(again.properties["seq"])) == 1
        assert again.redelivered
        assert again.delivery_count == 1  # a failed delivery: the broker counted it
        again.acknowledge()
        assert consumer.receive(0.5) is None
        # Built here, not received: nothing to release.
        with pytest.raises(IllegalStateError, match="nothing to release"):
            Message(body="mine").release()
        # Another mode says what to use instead.
        auto = connection.create_session(AckMode.AUTO)
        auto.create_producer(f"{queue}-auto").send(Message(body="auto"))
        taken = auto.create_consumer(f"{queue}-auto").receive(10)
        assert taken is not None
        with pytest.raises(IllegalStateError, match="CLIENT_INDIVIDUAL"):
            taken.release()
    assert drain(url_for(pair, protocol), queue, idle=0.3) == []


MAX_REDELIVERIES = 2


def test_releases_count_toward_max_redeliveries_through_a_failover(
    pair: BrokerPair, protocol: str
) -> None:
    queue = f"queue://released-{uuid.uuid4().hex[:8]}"
    url = url_for(pair, protocol, max_redeliveries=MAX_REDELIVERIES)
    counts: list[int] = []
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        session.create_producer(queue).send(Message(body="poison", properties={"seq": 0}))
        consumer = session.create_consumer(queue, prefetch=1)
        connection.start()
        message = consumer.receive(10)
        assert message is not None
        counts.append(message.delivery_count)
        message.release()
        message = consumer.receive(10)
        assert message is not None
        counts.append(message.delivery_count)
        # The live dies while the application holds the message: its release waits out the
        # failover, then is stale (the new broker session does not know the delivery).
        victim = pair.live
        pair.kill(victim)
        other = pair.nodes[1] if victim is pair.nodes[0] else pair.nodes[0]
        wait_until(lambda: other.role == "live", 20, "the backup to take over")
        with pytest.raises(StaleAcknowledgeError):
            message.release()
        assert connection.statistics().failovers == 1
        # The backup never heard of that failure; the consumer counted it, so the next
        # delivery is the last one handed out.
        message = consumer.receive(10)
        assert message is not None, f"not delivered again after {counts}"
        counts.append(message.delivery_count)
        message.release()
        # That was its third failure: the next delivery is rejected, never handed out.
        deadline = time.monotonic() + 20
        while not consumer.rejected and time.monotonic() < deadline:
            extra = consumer.receive(0.2)
            assert extra is None, f"handed out again after {counts}"
        assert consumer.rejected == 1
        assert counts[:2] == [0, 1]
    dead = drain(url_for(pair, protocol), "queue://DLQ", idle=0.5)
    assert [m.body_bytes for m in dead] == [b"poison"]
    assert drain(url_for(pair, protocol), queue, idle=0.3) == []


def test_a_release_after_its_consumer_closed_writes_nothing(
    pair: BrokerPair, protocol: str
) -> None:
    """The subscription's end gave the message back already: a NACK naming a subscription
    that is gone would be refused (on STOMP, with the connection)."""
    queue = f"queue://closed-{uuid.uuid4().hex[:8]}"
    with hafailover.connect(url_for(pair, protocol, heartbeat=STEADY_HEARTBEAT)) as connection:
        session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        session.create_producer(queue).send(Message(body="held", properties={"seq": 0}))
        consumer = session.create_consumer(queue, prefetch=1)
        connection.start()
        message = consumer.receive(10)
        assert message is not None
        consumer.close()
        message.release()
        again = session.create_consumer(queue).receive(10)
        assert again is not None
        assert again.body_bytes == b"held"
        again.acknowledge()
        time.sleep(0.5)  # a refusal would have ended the connection by now
        assert connection.statistics().failovers == 0


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL])
def test_an_acknowledge_after_its_consumer_closed_writes_nothing_and_says_so(
    pair: BrokerPair, protocol: str, mode: AckMode
) -> None:
    """The consumer's close gave its unacknowledged messages back. Acknowledging one after
    that must not name the ended subscription (STOMP refuses it with the connection): a
    CLIENT_INDIVIDUAL acknowledge raises, saying the message comes again; a CLIENT one
    acknowledges what the session still holds. Either way the message is delivered again."""
    queue = f"queue://closed-ack-{uuid.uuid4().hex[:8]}"
    other = f"queue://kept-ack-{uuid.uuid4().hex[:8]}"
    with hafailover.connect(url_for(pair, protocol, heartbeat=STEADY_HEARTBEAT)) as connection:
        session = connection.create_session(mode)
        session.create_producer(queue).send(Message(body="held"))
        session.create_producer(other).send(Message(body="kept"))
        closing = session.create_consumer(queue, prefetch=1)
        staying = session.create_consumer(other, prefetch=1)
        connection.start()
        message = closing.receive(10)
        kept = staying.receive(10)
        assert message is not None and kept is not None
        closing.close()
        if mode is AckMode.CLIENT_INDIVIDUAL:
            with pytest.raises(IllegalStateError, match="consumer closed"):
                message.acknowledge()
            kept.acknowledge()
        else:
            message.acknowledge()  # the session's acknowledge: what it still holds
        again = session.create_consumer(queue).receive(10)
        assert again is not None and again.body_bytes == b"held"
        again.acknowledge()
        time.sleep(0.5)  # a refusal would have ended the connection by now
        assert connection.statistics().failovers == 0
    assert drain(url_for(pair, protocol), other, idle=0.3) == []
    assert drain(url_for(pair, protocol), queue, idle=0.3) == []
