"""Zero prefetch on RabbitMQ 3.10's AMQP 1.0 plugin: a consumer with prefetch=0 gives credit
only while a receive waits and takes it back (a drain) when the receive times out, so one
that is not receiving holds nothing and its neighbour gets every message, as on the bundled
pair (tests/integration/test_zero_prefetch.py). But the plugin cannot drain: the drain of a
receive that timed out crashes its session process (``function_clause`` in
``rabbit_classic_queue:handle_event({send_drained, ...})``, answered as
``amqp:internal-error``), so each such receive costs a reconnect; nothing is lost or handed
out twice. Pinned here, so that a RabbitMQ that drains shows in docs/brokers.md. Over STOMP
prefetch=0 is refused by the client whatever the broker (docs/client.md)."""

from __future__ import annotations

import pytest

import hafailover
from tests.interop.conftest import RabbitMQ
from tests.interop.test_client_rabbitmq import failover_url, unique_queue

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


def test_an_idle_pull_consumer_holds_nothing(rabbitmq: RabbitMQ) -> None:
    queue = unique_queue("pull")
    with hafailover.connect(failover_url(rabbitmq, "amqp")) as connection:
        session = connection.create_session()
        idle = session.create_consumer(queue, prefetch=0)
        busy = session.create_consumer(queue, prefetch=0)
        connection.start()
        assert idle.receive(0.3) is None  # gave credit, then drained it back
        producer = session.create_producer(queue)
        for n in range(10):
            producer.send("m", headers={"seq": n})
        got = []
        while (message := busy.receive(2.0)) is not None:
            got.append(int(str(message.properties["seq"])))
        assert got == list(range(10))  # with prefetch=1 the idle consumer would hold one
        # Each timed-out receive's drain ended the session: a failover, nothing lost.
        assert connection.statistics().failovers >= 1
        assert all("internal-error" in r.reason for r in connection.reports), [
            r.summary() for r in connection.reports
        ]
