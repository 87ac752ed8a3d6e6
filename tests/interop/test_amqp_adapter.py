"""The AMQP 1.0 adapter against RabbitMQ: the same code path as against the reference broker."""

from __future__ import annotations

import time

import pytest

from hafailover.destination import Destination
from hafailover.errors import ProtocolError, SecurityError
from hafailover.message import Message
from hafailover.protocols.amqp.engine import Outcome
from hafailover.protocols.amqp.transport import AmqpTransport
from hafailover.url import BrokerAddress
from tests.adapters.test_amqp_transport import Recorder, reactor_threads
from tests.interop.conftest import RabbitMQ, RabbitMQControl, declare_nondurable_queue

pytestmark = [pytest.mark.timeout(60)]


def broker(rabbitmq: RabbitMQ, password: str | None = None) -> BrokerAddress:
    return BrokerAddress(
        "amqp", rabbitmq.host, rabbitmq.amqp_port, rabbitmq.user, password or rabbitmq.password
    )


@pytest.mark.interop
def test_rabbitmq_send_settle_receive(rabbitmq: RabbitMQ) -> None:
    events = Recorder()
    transport = AmqpTransport(events)
    opened = transport.open(broker(rabbitmq))
    assert opened.topology == ()  # RabbitMQ announces no topology
    assert opened.session_id is None
    queue = Destination.queue(f"hafailover-amqp-adapter-{time.monotonic_ns()}")
    sent = [
        Message(f"rabbit-{i}".encode(), properties={"seq": i}, correlation_id=f"c-{i}")
        for i in range(100)
    ]
    for i, message in enumerate(sent):
        transport.send(i, queue, message, duplicate_detection=True)
    events.wait(lambda: len(events.settled) == 100)
    assert all(error is None for error in events.settled.values())

    transport.subscribe("s", queue, credit=10, settle_on_delivery=False)
    events.wait(lambda: len(events.messages) == 100)
    for (_, delivery, received), original in zip(events.messages, sent, strict=True):
        assert received.body == original.body
        assert received.message_id == original.message_id
        assert received.correlation_id == original.correlation_id
        assert received.properties["seq"] == original.properties["seq"]  # typed on RabbitMQ
        assert received.persistent is True
        transport.settle(delivery, Outcome.ACCEPTED)
    transport.close()
    assert not events.lost
    assert not events.errors
    assert not reactor_threads()


@pytest.mark.interop
def test_rabbitmq_refuses_a_wrong_password(rabbitmq: RabbitMQ) -> None:
    # RabbitMQ answers a refused login after 3 s, longer than twice the heart-beat: the
    # idle timeout only starts once the login is done, so this is a refusal, not a loss.
    with pytest.raises(SecurityError, match="refused the login"):
        AmqpTransport(Recorder(), heartbeat=0.5).open(broker(rabbitmq, password="wrong"))
    assert not reactor_threads()


@pytest.mark.interop
def test_rabbitmq_heart_beats_keep_an_idle_connection(rabbitmq: RabbitMQ) -> None:
    events = Recorder()
    transport = AmqpTransport(events, heartbeat=1.0)
    transport.open(broker(rabbitmq))
    time.sleep(4)  # nothing to say: only heart-beats cross
    assert not events.lost
    transport.close()


@pytest.mark.interop
def test_rabbitmq_redelivers_a_released_message_marked(rabbitmq: RabbitMQ) -> None:
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(broker(rabbitmq))
    queue = Destination.queue(f"hafailover-amqp-release-{time.monotonic_ns()}")
    transport.send(1, queue, Message(b"again"), duplicate_detection=True)
    transport.subscribe("s", queue, credit=1, settle_on_delivery=False)
    events.wait(lambda: events.messages)
    _, first, message = events.messages[0]
    assert not message.redelivered
    transport.settle(first, Outcome.RELEASED)
    events.wait(lambda: len(events.messages) == 2)
    _, second, again = events.messages[1]
    assert again.redelivered
    assert again.message_id == message.message_id
    transport.settle(second, Outcome.ACCEPTED)
    transport.close()


@pytest.mark.interop
def test_rabbitmq_has_no_transactions_and_says_so(rabbitmq: RabbitMQ) -> None:
    # RabbitMQ 3.10 ends the whole session on a coordinator link: the call raises the
    # broker's refusal (not a retryable loss) and the connection is reported lost.
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(broker(rabbitmq))
    with pytest.raises(ProtocolError, match="amqp:not-implemented"):
        transport.declare(timeout=10)
    events.wait(lambda: events.lost)
    assert "not-implemented" in events.lost[0]
    transport.close()
    assert not reactor_threads()


@pytest.mark.interop
def test_rabbitmq_declares_the_adapters_queues_durable(
    rabbitmq: RabbitMQ, rabbitmq_control: RabbitMQControl
) -> None:
    # The adapter's sender declares the queue durable, and its receiver (durable too, or
    # RabbitMQ would refuse it) attaches to that queue.
    name = f"hafailover-amqp-durable-{time.monotonic_ns()}"
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(broker(rabbitmq))
    transport.send(1, Destination.queue(name), Message(b"kept"), duplicate_detection=False)
    events.wait(lambda: 1 in events.settled)
    assert events.settled[1] is None
    assert rabbitmq_control.queue_durable(name) is True
    transport.subscribe("s", Destination.queue(name), credit=1, settle_on_delivery=True)
    events.wait(lambda: events.messages)
    assert events.bodies() == [b"kept"]
    transport.close()
    assert not events.lost
    assert not events.errors


@pytest.mark.interop
def test_rabbitmq_refusing_the_sender_settles_the_send_with_the_refusal(
    rabbitmq: RabbitMQ,
) -> None:
    # A queue of another durability: RabbitMQ ends the session. The send, never transferred,
    # is settled with the refusal; the connection is reported lost, once.
    name = f"hafailover-amqp-nondurable-{time.monotonic_ns()}"
    declare_nondurable_queue(rabbitmq, name)
    events = Recorder()
    transport = AmqpTransport(events)
    transport.open(broker(rabbitmq))
    transport.send(1, Destination.queue(name), Message(b"never"), duplicate_detection=False)
    events.wait(lambda: 1 in events.settled and events.lost)
    error = events.settled[1]
    assert type(error) is ProtocolError
    assert "amqp:precondition-failed" in str(error)
    assert f"for queue '{name}'" in str(error)
    assert len(events.lost) == 1
    transport.close()
    assert not reactor_threads()
