"""The kombu transport against the bundled pair, on both protocols: what kombu's channel
contract asks (publish, consume, ack, reject, requeue, qos, declarations, broadcast)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import kombu
import pytest

import hafailover.kombu  # noqa: F401 - registers the "hafailover" alias
from hafailover import (
    ConfigurationError,
    DisconnectedError,
    InvalidURLError,
    NotConnectedError,
)
from reference_broker import BrokerPair

from .conftest import kombu_url

pytestmark = pytest.mark.broker


def drain(
    connection: kombu.Connection, received: list[Any], count: int, limit: float = 10.0
) -> None:
    deadline = time.monotonic() + limit
    while len(received) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(received)} of {count} messages within {limit}s"
        try:
            connection.drain_events(timeout=left)
        except TimeoutError:
            continue


def drain_until_it_raises(connection: kombu.Connection, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=1)


def quiet(connection: kombu.Connection, seconds: float) -> None:
    """Run the callbacks for ``seconds`` (what arrives in that time is delivered)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            connection.drain_events(timeout=left)
        except TimeoutError:
            return


def put_then_get(connection: kombu.Connection, name: str, count: int) -> tuple[Any, list[Any]]:
    """A SimpleQueue of ``name``, ``count`` messages put on it and got back, held."""
    queue = connection.SimpleQueue(name)
    for seq in range(count):
        queue.put({"seq": seq})
    return queue, [queue.get(timeout=5) for _ in range(count)]


def test_publish_consume_ack_keeps_headers_and_properties(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    task_queue = kombu.Queue(name, kombu.Exchange(name, "direct"), routing_key=name)
    with kombu.Connection(url) as connection:
        with connection.Producer() as producer:
            for seq in range(20):
                producer.publish(
                    {"seq": seq, "args": [1, "two"]},
                    exchange=task_queue.exchange,
                    routing_key=name,
                    declare=[task_queue],
                    headers={"task": "add", "nested": {"retries": seq, "eta": None}},
                    correlation_id=f"c-{seq}",
                    reply_to="replies",
                    priority=7,
                )
        received: list[kombu.Message] = []

        def on_message(body: dict[str, Any], message: kombu.Message) -> None:
            received.append(message)
            message.ack()

        with connection.Consumer(task_queue, callbacks=[on_message]):
            drain(connection, received, 20)
        assert [m.decode()["seq"] for m in received] == list(range(20))
        first = received[0]
        assert first.headers == {"task": "add", "nested": {"retries": 0, "eta": None}}
        assert first.properties["correlation_id"] == "c-0"
        assert first.properties["reply_to"] == "replies"
        assert first.properties["priority"] == 7
        assert first.content_type == "application/json"
        assert first.delivery_info["routing_key"] == name
        assert first.delivery_info["exchange"] == name
        assert first.delivery_info["redelivered"] is False
    # Acknowledged: nothing comes again on a new connection.
    with kombu.Connection(url) as connection:
        again: list[kombu.Message] = []
        with connection.Consumer(task_queue, callbacks=[lambda b, m: again.append(m)]):
            quiet(connection, 1.0)
        assert again == []


def test_unacknowledged_messages_come_back_redelivered(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    with kombu.Connection(url) as connection:
        queue, held = put_then_get(connection, name, 3)
        assert [m.payload["seq"] for m in held] == [0, 1, 2]
        held[1].ack()
        queue.close()
    # The connection ended holding 0 and 2: the broker gives them to the next consumer.
    with kombu.Connection(url) as connection:
        queue = connection.SimpleQueue(name)
        again = [queue.get(timeout=5) for _ in range(2)]
        assert sorted(m.payload["seq"] for m in again) == [0, 2]
        assert all(m.delivery_info["redelivered"] for m in again)
        for message in again:
            message.ack()
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        queue.close()


def test_reject_requeue_delivers_again_and_reject_discards(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    with kombu.Connection(url) as connection:
        queue = connection.SimpleQueue(name)
        queue.put({"seq": 1})
        queue.put({"seq": 2})
        first = queue.get(timeout=5)
        second = queue.get(timeout=5)
        first.requeue()
        second.reject()
        again = queue.get(timeout=5)
        assert again.payload == {"seq": 1}
        assert again.delivery_info["redelivered"] is True
        again.ack()
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        queue.close()


def test_prefetch_bounds_what_a_consumer_holds_unacknowledged(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    task_queue = kombu.Queue(name)
    with kombu.Connection(url) as connection:
        with connection.Producer() as producer:
            for seq in range(10):
                producer.publish({"seq": seq}, routing_key=name, declare=[task_queue])
        held: list[kombu.Message] = []
        acking: list[bool] = []

        def on_message(body: object, message: kombu.Message) -> None:
            held.append(message)
            if acking:
                message.ack()

        consumer = connection.Consumer(task_queue, callbacks=[on_message])
        consumer.qos(prefetch_count=3)
        with consumer:
            quiet(connection, 1.0)
            assert len(held) == 3
            held[0].ack()
            quiet(connection, 1.0)
            assert len(held) == 4
            acking.append(True)
            for message in held[1:]:
                message.ack()
            drain(connection, held, 10)
        assert sorted(m.decode()["seq"] for m in held) == list(range(10))


def test_drain_events_times_out(shared_pair: BrokerPair, protocol: str, name: str) -> None:
    with (
        kombu.Connection(kombu_url(shared_pair, protocol)) as connection,
        connection.Consumer(kombu.Queue(name), callbacks=[lambda b, m: None]),
    ):
        started = time.monotonic()
        with pytest.raises(socket.timeout):  # kombu's name for it
            connection.drain_events(timeout=0.3)
        assert time.monotonic() - started < 5.0


def test_fanout_reaches_every_bound_queue(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    fanout = kombu.Exchange(f"{name}.fan", "fanout", durable=False, auto_delete=True)
    queues = [kombu.Queue(f"{name}.{n}", fanout, auto_delete=True) for n in ("a", "b")]
    with kombu.Connection(url) as connection:
        received: list[tuple[str, Any]] = []
        consumers = [
            connection.Consumer(
                q, callbacks=[lambda b, m, q=q: (received.append((q.name, b)), m.ack())]
            )
            for q in queues
        ]
        for consumer in consumers:
            consumer.consume()
        quiet(connection, 0.5)  # the subscriptions are in place
        with kombu.Connection(url) as sender, sender.Producer() as producer:
            producer.publish({"ping": 1}, exchange=fanout, routing_key="ignored", declare=[fanout])
        drain(connection, received, 2)
        quiet(connection, 0.5)
        assert sorted(received) == [(queues[0].name, {"ping": 1}), (queues[1].name, {"ping": 1})]
        for consumer in consumers:
            consumer.cancel()


def test_topic_and_transient_direct_exchanges_route_by_key(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    topic = kombu.Exchange(f"{name}.ev", "topic", durable=False)
    replies = kombu.Exchange(f"{name}.reply", "direct", durable=False)
    queues = [
        kombu.Queue(f"{name}.workers", topic, routing_key="worker.#"),
        kombu.Queue(f"{name}.tasks", topic, routing_key="task.*.done"),
        kombu.Queue(f"{name}.mine", replies, routing_key="oid-1"),
    ]
    with kombu.Connection(url) as connection:
        received: list[tuple[str, str]] = []
        consumers = [
            connection.Consumer(
                q, callbacks=[lambda b, m, q=q: (received.append((q.name, b["k"])), m.ack())]
            )
            for q in queues
        ]
        for consumer in consumers:
            consumer.consume()
        quiet(connection, 0.5)
        with connection.Producer() as producer:
            for key in ("worker.heartbeat", "worker", "task.x.done", "task.x.y.done", "other"):
                producer.publish({"k": key}, exchange=topic, routing_key=key, declare=[topic])
            for key in ("oid-1", "oid-2"):
                producer.publish({"k": key}, exchange=replies, routing_key=key, declare=[replies])
        drain(connection, received, 4)
        quiet(connection, 0.5)
        assert sorted(received) == sorted(
            [
                (f"{name}.workers", "worker.heartbeat"),
                (f"{name}.workers", "worker"),
                (f"{name}.tasks", "task.x.done"),
                (f"{name}.mine", "oid-1"),
            ]
        )


def test_purge_counts_and_removes_waiting_messages(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    with kombu.Connection(kombu_url(shared_pair, protocol)) as connection:
        queue = connection.SimpleQueue(name)
        for seq in range(5):
            queue.put({"seq": seq})
        assert queue.clear() == 5
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        queue.close()


def test_transport_options_reach_the_url_and_bad_ones_are_named(
    shared_pair: BrokerPair, protocol: str
) -> None:
    url = kombu_url(shared_pair, protocol)
    with kombu.Connection(url, transport_options={"call_timeout": "5s", "max_retries": 3}) as c:
        c.connect()
        assert c.connection.ha.policy.call_timeout == 5.0
    with pytest.raises(InvalidURLError, match="no_such_option"):
        kombu.Connection(url, transport_options={"no_such_option": 1}).connect()
    with pytest.raises(ConfigurationError, match="confirm_publish"):
        kombu.Connection(url, transport_options={"confirm_publish": "yes"}).connect()


def test_headers_exchange_is_refused_by_name(
    shared_pair: BrokerPair, protocol: str, name: str
) -> None:
    with (
        kombu.Connection(kombu_url(shared_pair, protocol)) as connection,
        pytest.raises(ConfigurationError, match="headers"),
    ):
        kombu.Exchange(name, "headers")(connection.default_channel).declare()


def test_a_url_that_is_not_hafailover_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="hafailover URL"):
        kombu.Connection("localhost", transport="hafailover.kombu:Transport").connect()


def test_an_ack_returns_once_written_as_py_amqps_does(
    pair: BrokerPair, protocol: str, name: str
) -> None:
    """A pool thread's ack does not wait a broker round trip: with the live stopped
    (SIGSTOP), an ack still returns; once the live goes on, it has taken both. (Heart-beats
    of 5 s: the stopped second must not be taken for a lost live, which F1 would wait out.)"""
    url = kombu_url(pair, protocol, heartbeat="5s")
    with kombu.Connection(url) as connection:
        queue, held = put_then_get(connection, name, 2)
        pair.pause(pair.live)
        try:
            acking = threading.Thread(target=held[0].ack)
            acking.start()
            acking.join(1.0)
            assert not acking.is_alive(), "the ack waited for the broker"
        finally:
            pair.resume(pair.live)
        held[1].ack()
        queue.close()
    with kombu.Connection(url) as connection:  # both acks arrived: nothing comes again
        queue = connection.SimpleQueue(name)
        with pytest.raises(queue.Empty):
            queue.get(timeout=1.0)
        queue.close()


def test_a_connection_hafailover_gave_up_on_reaches_drain_events(
    pair: BrokerPair, protocol: str, name: str
) -> None:
    """Celery restarts its consumer on a connection error from drain_events: that is where
    hafailover's DISCONNECT must arrive, and only there (a failover never does)."""
    url = kombu_url(pair, protocol, reconnect_attempts=3)
    with (
        kombu.Connection(url) as connection,
        connection.Consumer(kombu.Queue(name), callbacks=[lambda b, m: None]),
    ):
        for node in (pair.live, pair.backup):
            pair.kill(node)
        # hafailover's DISCONNECT, raised by the drain it came in; or, when it came
        # between two drains, kombu's attempt to connect again, which fails too.
        with pytest.raises((DisconnectedError, NotConnectedError)) as caught:
            drain_until_it_raises(connection, limit=20.0)
        assert isinstance(caught.value, connection.connection_errors)
        assert not connection.connected


def test_a_requeue_gives_the_message_itself_back_until_the_brokers_limit_dead_letters_it(
    tmp_path: Path, protocol: str, name: str
) -> None:
    """reject(requeue=True) returns the delivered message (same id, redelivered), not a copy
    under a new id: so the broker counts its deliveries and its limit applies."""
    with BrokerPair(
        tmp_path / "pair",
        user="app",
        password="secret",
        node_options=["--max-delivery-attempts", "3", "--dead-letter-queue", "queue://poison"],
    ) as pair:
        pair.wait_synchronized(30)
        with kombu.Connection(kombu_url(pair, protocol)) as connection:
            queue = connection.SimpleQueue(name)
            queue.put({"seq": 1})
            ids = []
            for attempt in range(3):
                message = queue.get(timeout=5)
                assert message.payload == {"seq": 1}
                assert message.delivery_info["redelivered"] is (attempt > 0)
                ids.append(message.properties.get("message_id"))
                message.requeue()
            assert len(set(ids)) == 1 and ids[0], f"a requeue sent a copy: ids {ids}"
            with pytest.raises(queue.Empty):
                queue.get(timeout=1)
            queue.close()
            poison = connection.SimpleQueue("poison")
            dead = poison.get(timeout=5)
            assert dead.payload == {"seq": 1}
            dead.ack()
            poison.close()
