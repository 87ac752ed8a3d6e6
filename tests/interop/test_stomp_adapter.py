"""The STOMP adapter against RabbitMQ: the same code path as against the reference broker."""

from __future__ import annotations

import time

import pytest

from hafailover.protocols.stomp.transport import StompTransport
from hafailover.url import BrokerAddress
from tests.adapters.test_stomp_transport import Recorder
from tests.interop.conftest import RabbitMQ

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.interop
def test_rabbitmq_round_trip(rabbitmq: RabbitMQ) -> None:
    events = Recorder()
    transport = StompTransport(events)
    broker = BrokerAddress(
        "stomp", rabbitmq.host, rabbitmq.stomp_port, rabbitmq.user, rabbitmq.password
    )
    opened = transport.open(broker, window=100_000, connection_ttl=10)
    assert opened.session_id is None  # RabbitMQ has no reattach extension
    queue = f"/queue/hafailover-adapter-{time.monotonic_ns()}"
    transport.write("SEND", {"destination": queue, "persistent": "true", "receipt": "r"}, b"rabbit")
    events.wait(lambda: "r" in events.receipts)
    transport.write("SUBSCRIBE", {"id": "s", "destination": queue, "ack": "client-individual"})
    events.wait(lambda: events.messages)
    _, ack_id, message = events.messages[0]
    assert message.body == b"rabbit"
    transport.write("ACK", {"id": ack_id})
    transport.close()
