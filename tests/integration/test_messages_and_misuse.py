"""Messages arrive as sent, and misuse gets a clear error that harms nothing else.

Against the bundled pair, on both protocols: binary bodies with every byte value, headers,
priority and persistence; then bad input (URLs, options, closed sessions, foreign messages,
commit outside a transaction, oversized messages), each followed by a check that the
connection and its other sessions still work.
"""

from __future__ import annotations

import pytest

import hafailover
from hafailover import (
    AckMode,
    ConfigurationError,
    ConnectionClosedError,
    Destination,
    DestinationKind,
    IllegalStateError,
    InvalidURLError,
    Message,
    MessageTooLargeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
)
from hafailover.connection import MAX_MESSAGE_BYTES
from reference_broker import BrokerPair

from .support import STEADY_HEARTBEAT, url_for

pytestmark = pytest.mark.timeout(60)


def test_every_byte_value_and_the_headers_arrive(pair: BrokerPair, protocol: str) -> None:
    """A body holding every byte value (NUL included) is neither cut nor corrupted."""
    body = bytes(range(256)) * 8
    with hafailover.connect(url_for(pair, protocol, heartbeat=STEADY_HEARTBEAT)) as connection:
        session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        producer = session.create_producer("queue://bytes")
        sent = producer.send(
            Message(body=body, properties={"seq": 7, "kind": "binary"}, priority=7)
        )
        producer.send("text body", headers={"seq": 8})
        consumer = session.create_consumer("queue://bytes")
        connection.start()
        first = consumer.receive(5)
        second = consumer.receive(5)
        assert first is not None
        assert second is not None
        assert first.body_bytes == body
        assert str(first.properties["kind"]) == "binary"
        assert str(first.properties["seq"]) == "7"
        assert first.message_id is not None
        assert sent.message_id is not None
        assert second.text == "text body"
        first.acknowledge()
        second.acknowledge()
        assert connection.statistics().failovers == 0


def test_one_message_object_sent_from_two_threads_is_unchanged_and_stored_once(
    pair: BrokerPair, protocol: str
) -> None:
    """A send never changes the application's Message: two threads send one object with
    different headers, each copy carries the object's one id, and with duplicate detection
    the broker keeps one of them (F13)."""
    import threading

    original = Message(body="shared", properties={"kind": "order"})
    with hafailover.connect(url_for(pair, protocol)) as connection:
        sent: list[Message] = []

        def send(n: int) -> None:
            producer = connection.create_session().create_producer("queue://shared-object")
            sent.append(producer.send(original, headers={"thread": n}))

        threads = [threading.Thread(target=send, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert len(sent) == 2
        assert original.properties == {"kind": "order"} and original.message_id is None
        assert sent[0].message_id == sent[1].message_id is not None
        consumer = connection.create_session().create_consumer("queue://shared-object")
        connection.start()
        first = consumer.receive(5)
        assert first is not None and str(first.properties["thread"]) in ("0", "1")
        assert consumer.receive(1) is None  # the broker dropped the copy by its duplicate id


def test_bad_urls_and_options_name_what_is_wrong() -> None:
    with pytest.raises(InvalidURLError) as raised:
        hafailover.connect("failover:(stomp://h:1)?reconnect_attempts=often")
    assert raised.value.option == "reconnect_attempts"
    with pytest.raises(InvalidURLError) as raised:
        hafailover.connect("failover:(stomp://h:1)?no_such_option=1")
    assert raised.value.option == "no_such_option"
    with pytest.raises(InvalidURLError):
        hafailover.connect("failover:(stomp://h:1,amqp://h:2)")
    with pytest.raises(ConfigurationError):
        hafailover.connect("ftp://h:1")


def test_misuse_is_refused_and_harms_nothing(pair: BrokerPair, protocol: str) -> None:
    with hafailover.connect(url_for(pair, protocol, heartbeat=STEADY_HEARTBEAT)) as connection:
        healthy = connection.create_session()
        healthy_producer = healthy.create_producer("queue://misuse")

        closed = connection.create_session()
        closed_producer = closed.create_producer("queue://misuse")
        closed.close()
        with pytest.raises(ConnectionClosedError):
            closed_producer.send("after close")

        with pytest.raises(IllegalStateError):
            healthy.commit()
        with pytest.raises(IllegalStateError):
            healthy.rollback()
        with pytest.raises(IllegalStateError):
            healthy.acknowledge()
        with pytest.raises(ConfigurationError):
            connection.create_session("auto")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            healthy.create_consumer("queue://misuse", prefetch=-1)
        with pytest.raises(ConfigurationError):
            healthy_producer.send(12345)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            healthy.create_producer("nowhere://x")
        with pytest.raises(IllegalStateError):
            healthy.create_producer().send("no destination")
        with pytest.raises(MessageTooLargeError):
            healthy_producer.send(b"x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(IllegalStateError):
            Message(body="built here").acknowledge()

        # A message of one session acknowledged through another session is refused.
        healthy_producer.send("foreign", headers={"seq": 1})
        owner = connection.create_session(AckMode.CLIENT)
        other = connection.create_session(AckMode.CLIENT)
        consumer = owner.create_consumer("queue://misuse")
        connection.start()
        message = consumer.receive(5)
        assert message is not None
        with pytest.raises(IllegalStateError):
            other._acknowledge_message(message)
        message.acknowledge()

        # Everything still works.
        healthy_producer.send("still fine")
        again = consumer.receive(5)
        assert again is not None
        assert again.text == "still fine"
        again.acknowledge()
        assert connection.statistics().failovers == 0


def test_a_send_the_broker_refuses_rolls_the_transaction_back(
    pair: BrokerPair, protocol: str
) -> None:
    """A transacted send to an address that does not exist: the commit does not happen, the
    error says why, and the same session commits its next transaction."""
    missing = Destination(DestinationKind.TEMPORARY_QUEUE, "never-created")
    with hafailover.connect(url_for(pair, protocol)) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer("queue://refused-tx")
        producer.send("rolled back", headers={"seq": 1})
        session.create_producer(missing).send("nowhere")
        if protocol == "amqp":
            # AMQP rejects the transfer: the commit rolls the transaction back.
            with pytest.raises(TransactionRolledBackError, match="never-created"):
                session.commit()
        else:
            # A STOMP broker answers with ERROR and closes the connection: the commit's
            # answer is lost with it, and the client cannot say more than that.
            with pytest.raises(TransactionOutcomeUnknownError):
                session.commit()
        producer.send("committed", headers={"seq": 2})
        session.commit()
        reader = connection.create_session()
        consumer = reader.create_consumer("queue://refused-tx")
        connection.start()
        bodies = []
        while (message := consumer.receive(1.0)) is not None:
            bodies.append(message.text)
        assert bodies == ["committed"]


def test_a_message_amqp_cannot_encode_is_refused_and_harms_nothing(pair: BrokerPair) -> None:
    """An integer property beyond AMQP's range: each kind of send raises a clear error at
    once (never a failover, never a hang) and the rest of the transaction commits."""
    with hafailover.connect(url_for(pair, "amqp", heartbeat=STEADY_HEARTBEAT)) as connection:
        too_big = {"seq": 2, "big": 2**70}
        fire_and_forget = connection.create_session().create_producer(
            "queue://unencodable", confirm=False
        )
        with pytest.raises(ConfigurationError, match="cannot be encoded"):
            fire_and_forget.send("x", headers=too_big)
        confirmed = connection.create_session().create_producer("queue://unencodable")
        with pytest.raises(ConfigurationError, match="cannot be encoded"):
            confirmed.send("x", headers=too_big)
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer("queue://unencodable")
        producer.send("kept", headers={"seq": 1})
        with pytest.raises(ConfigurationError, match="cannot be encoded"):
            producer.send("x", headers=too_big)
        producer.send("kept too", headers={"seq": 3})
        session.commit()
        consumer = connection.create_session().create_consumer("queue://unencodable")
        connection.start()
        bodies = []
        while (message := consumer.receive(1.0)) is not None:
            bodies.append(message.text)
        assert bodies == ["kept", "kept too"]
        assert connection.statistics().failovers == 0
