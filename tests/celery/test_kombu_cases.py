"""The cases of kombu's shared transport integration tests (``t/integration/common.py`` in
kombu's source: basic functionality, exchange types, time to live, priority, message
settlement), written again for this transport on the bundled pair, both protocols. Where a
case cannot apply as kombu wrote it, the version here says how it differs, and docs/celery.md
lists it with the reason."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import kombu
import pytest

import hafailover.kombu  # noqa: F401 - registers the "hafailover" alias
from hafailover.kombu import Transport
from reference_broker import BrokerPair

from .conftest import kombu_url

pytestmark = pytest.mark.broker


@pytest.fixture
def connection(shared_pair: BrokerPair, protocol: str) -> kombu.Connection:
    return kombu.Connection(kombu_url(shared_pair, protocol))


def consume_one(connection: kombu.Connection, queue: kombu.Queue) -> Any:
    """What one drain_events of a fresh consumer of ``queue`` delivers (socket.timeout if
    nothing within a second)."""
    bodies: list[Any] = []

    def callback(body: Any, message: kombu.Message) -> None:
        message.ack()
        bodies.append(body)

    with kombu.Consumer(connection, [queue], accept=["pickle", "json"], callbacks=[callback]):
        connection.drain_events(timeout=1)
    return bodies[0]


@contextlib.contextmanager
def _ignore_timeout() -> Iterator[None]:
    with contextlib.suppress(socket.timeout):
        yield


class TestBasicFunctionality:
    def test_connect_close_connect(self, connection: kombu.Connection) -> None:
        assert connection.connect()
        assert connection.connection
        connection.close()
        assert connection.connection is None
        assert connection.connect()
        connection.close()

    def test_failed_connect_is_a_connection_error(self, protocol: str) -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        url = f"hafailover+{protocol}://127.0.0.1:{port}?reconnect_attempts=0"
        with pytest.raises(Transport.connection_errors):
            kombu.Connection(url, transport_options={"max_retries": 1}).connect()

    def test_default_channel_connects(self, connection: kombu.Connection) -> None:
        with connection:
            assert connection.default_channel
            assert connection.connection

    def test_publish_consume_pickle(self, connection: kombu.Connection, name: str) -> None:
        queue = kombu.Queue(name, routing_key=name)
        with connection as conn, conn.channel() as channel:
            kombu.Producer(channel).publish(
                {"hello": "world"},
                retry=True,
                exchange=queue.exchange,
                routing_key=name,
                declare=[queue],
                serializer="pickle",
            )
            received: list[kombu.Message] = []
            consumer = kombu.Consumer(conn, [queue], accept=["pickle"])
            consumer.register_callback(lambda body, message: received.append(message))
            with consumer:
                conn.drain_events(timeout=1)
            assert received[0].payload == {"hello": "world"}
            assert received[0].content_type == "application/x-python-serialize"
            assert received[0].delivery_info["routing_key"] == name
            received[0].ack()

    def test_consume_empty_queue_times_out(self, connection: kombu.Connection, name: str) -> None:
        with (
            connection as conn,
            kombu.Consumer(conn, [kombu.Queue(name)]),
            pytest.raises(socket.timeout),
        ):
            conn.drain_events(timeout=1)

    def test_simple_queue(self, connection: kombu.Connection, name: str) -> None:
        with connection as conn, closing(conn.SimpleQueue(name)) as queue:
            queue.put({"Hello": "World"}, headers={"k1": "v1"})
            message = queue.get(timeout=1)
            assert message.payload == {"Hello": "World"}
            assert message.content_type == "application/json"
            assert message.content_encoding == "utf-8"
            assert message.headers == {"k1": "v1"}
            message.ack()

    def test_simple_buffer(self, connection: kombu.Connection, name: str) -> None:
        with connection as conn, closing(conn.SimpleBuffer(name)) as buffer:
            buffer.put({"Hello": "World"}, headers={"k1": "v1"})
            message = buffer.get(timeout=1)
            assert message.payload == {"Hello": "World"}
            assert message.headers == {"k1": "v1"}
            message.ack()  # a no-ack consumer's ack is a no-op, as kombu has it


class TestExchangeTypes:
    def publish(
        self, channel: Any, exchange: kombu.Exchange, queues: list[kombu.Queue], key: str = ""
    ) -> None:
        kombu.Producer(channel, exchange=exchange).publish(
            {"hello": "world"}, declare=list(queues) or None, serializer="pickle", routing_key=key
        )

    def test_direct(self, connection: kombu.Connection, name: str) -> None:
        exchange = kombu.Exchange(name, type="direct")
        queue = kombu.Queue(f"{name}.1", exchange=exchange)
        with connection as conn, conn.channel() as channel:
            self.publish(channel, exchange, [queue])
            assert consume_one(conn, queue) == {"hello": "world"}

    def test_direct_routing_keys(self, connection: kombu.Connection, name: str) -> None:
        exchange = kombu.Exchange(name, type="direct")
        first = kombu.Queue(f"{name}.1", exchange=exchange, routing_key="d1")
        second = kombu.Queue(f"{name}.2", exchange=exchange, routing_key="d2")
        with connection as conn, conn.channel() as channel:
            self.publish(channel, exchange, [first, second], "d1")
            assert consume_one(conn, first) == {"hello": "world"}
            with pytest.raises(socket.timeout):
                consume_one(conn, second)
            # A key no queue is bound under: the message is dropped.
            self.publish(channel, exchange, [first, second], "d3")
            for queue in (first, second):
                with pytest.raises(socket.timeout):
                    consume_one(conn, queue)

    def test_fanout(self, connection: kombu.Connection, name: str) -> None:
        # Differs from kombu's case: a fanout queue is a topic subscription here, which keeps
        # what is published while it is consumed, so the consumers start first.
        exchange = kombu.Exchange(name, type="fanout")
        queues = [kombu.Queue(f"{name}.{n}", exchange=exchange) for n in (1, 2)]
        received: list[str] = []
        with connection as conn, conn.channel() as channel:
            consumers = [
                kombu.Consumer(
                    conn,
                    [q],
                    accept=["pickle"],
                    callbacks=[lambda b, m, q=q: (received.append(q.name), m.ack())],
                )
                for q in queues
            ]
            for consumer in consumers:
                consumer.consume()
            time.sleep(0.3)  # the subscriptions reach the broker
            self.publish(channel, exchange, queues)
            deadline = time.monotonic() + 5
            while len(received) < 2 and time.monotonic() < deadline:
                with _ignore_timeout():
                    conn.drain_events(timeout=1)
            assert sorted(received) == [q.name for q in queues]

    def test_topic(self, connection: kombu.Connection, name: str) -> None:
        exchange = kombu.Exchange(name, type="topic")
        queues = [
            kombu.Queue(f"{name}.1", exchange=exchange, routing_key="t.*"),
            kombu.Queue(f"{name}.2", exchange=exchange, routing_key="t.*"),
            kombu.Queue(f"{name}.3", exchange=exchange, routing_key="t"),
        ]
        received: list[str] = []
        with connection as conn, conn.channel() as channel:
            consumers = [
                kombu.Consumer(
                    conn,
                    [q],
                    accept=["pickle"],
                    callbacks=[lambda b, m, q=q: (received.append(q.name), m.ack())],
                )
                for q in queues
            ]
            for consumer in consumers:
                consumer.consume()
            time.sleep(0.3)
            self.publish(channel, exchange, queues, "t.1")
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                with _ignore_timeout():
                    conn.drain_events(timeout=0.5)
            assert sorted(received) == [f"{name}.1", f"{name}.2"]

    def test_publish_to_an_exchange_without_queues(
        self, connection: kombu.Connection, name: str
    ) -> None:
        with connection as conn, conn.channel() as channel:
            self.publish(channel, kombu.Exchange(name, type="topic"), [], "t.1")


class TestTimeToLive:
    def test_expired_message_is_not_delivered(
        self, connection: kombu.Connection, name: str
    ) -> None:
        with connection as conn, closing(conn.SimpleQueue(name)) as queue:
            queue.put({"Hello": "World"}, expiration=0.5)
            queue.put({"Hello": "again"})
            time.sleep(1.0)
            message = queue.get(timeout=2)
            assert message.payload == {"Hello": "again"}
            message.ack()
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.5)


class TestPriority:
    def test_higher_priority_first(self, connection: kombu.Connection, name: str) -> None:
        with (
            connection as conn,
            closing(conn.SimpleQueue(name, queue_opts={"max_priority": 10})) as queue,
        ):
            for body, priority in (("first", 1), ("second", 7), ("third", 1)):
                queue.put({"msg": body}, priority=priority)
            time.sleep(0.5)
            bodies = []
            for _ in range(3):
                message = queue.get(timeout=2)
                message.ack()
                bodies.append(message.payload["msg"])
            assert bodies == ["second", "first", "third"]


class TestMessage:
    def test_ack(self, connection: kombu.Connection, name: str) -> None:
        with connection as conn, closing(conn.SimpleQueue(name)) as queue:
            queue.put({"Hello": "World"})
            queue.get(timeout=2).ack()
            with pytest.raises(queue.Empty):
                queue.get_nowait()

    def test_reject_without_requeue(self, connection: kombu.Connection, name: str) -> None:
        with connection as conn, closing(conn.SimpleQueue(name)) as queue:
            queue.put({"Hello": "World"})
            queue.get(timeout=2).reject(requeue=False)
            with pytest.raises(queue.Empty):
                queue.get_nowait()

    @pytest.mark.parametrize("how", ["reject", "requeue"])
    def test_requeue(self, connection: kombu.Connection, name: str, how: str) -> None:
        with connection as conn, closing(conn.SimpleQueue(name)) as queue:
            queue.put({"Hello": "World"})
            message = queue.get(timeout=2)
            if how == "reject":
                message.reject(requeue=True)
            else:
                message.requeue()
            again = queue.get(timeout=2)
            assert again.body == message.body
            again.ack()
