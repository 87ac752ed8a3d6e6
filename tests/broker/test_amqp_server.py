"""The broker's AMQP 1.0 server against real proton clients.

Most tests run the server in this process: a BrokerCore with a journal in tmp_path on an
asyncio loop in a background thread (the broker itself is single-threaded, as in a node),
and blocking clients in the test's thread. The failover test runs a real pair of node
processes and SIGKILLs the live. Clients are raw proton (``BlockingConnection``, or
``RawClient`` below: a proton connection driven over a plain socket, for what the blocking
API cannot do: transactions, drain, silence, pipelining), never the hafailover library.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import (
    UNDESCRIBED,
    Array,
    Collector,
    Condition,
    Connection,
    ConnectionException,
    Data,
    Delivery,
    Described,
    Endpoint,
    Event,
    Link,
    Message,
    Receiver,
    Sender,
    Terminus,
    Timeout,
    Transport,
    symbol,
    ulong,
)
from proton.reactor import AtMostOnce, Copy, Selector
from proton.utils import BlockingConnection, LinkDetached, SendException

from reference_broker.amqp.sasl import AMQP_HEADER, SASL_HEADER, SASL_INIT, encode_sasl_frame
from reference_broker.amqp.server import TOPOLOGY_PROPERTY, AmqpConnection
from reference_broker.core import BrokerCore, ServeConfig
from reference_broker.engine import Engine, EngineConfig
from reference_broker.journal import Journal, SyncPolicy
from reference_broker.pair import BrokerPair
from reference_broker.records import decode
from reference_broker.stomp.server import StompConnection
from reference_broker.store import Store
from reference_broker.users import UsersFile
from tests.broker.stomp_wire import WireClient

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
TOPOLOGY = ("127.0.0.1:5672", "127.0.0.1:5673")


# --- an in-process broker -------------------------------------------------------------------


class InProcessBroker:
    """A BrokerCore and an AMQP listener on a loop thread; the journal survives restarts."""

    def __init__(
        self,
        data_dir: Path,
        users: UsersFile,
        *,
        engine_config: EngineConfig | None = None,
        **config: Any,
    ) -> None:
        self.data_dir = data_dir
        self.users = users
        self.engine_config = engine_config or EngineConfig(node_id="live")
        self.config = ServeConfig(node_id="live", topology={"amqp": TOPOLOGY}, **config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = 0
        self.stomp_port = 0
        self.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the broker's loop (the engine is not thread-safe) and return its value."""

        async def call() -> T:
            return fn()

        return self.run(call())

    def start(self) -> None:
        self.run(self._start())

    async def _start(self) -> None:
        journal = await asyncio.to_thread(
            Journal.open, self.data_dir / "journal", sync=SyncPolicy.never()
        )
        engine = Engine.recover(
            (decode(r.type, r.payload) for r in journal.replay()), self.engine_config
        )
        self.store = Store(journal)
        self.core = BrokerCore(engine, self.store, self.users, self.config)
        self.core.start()
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: AmqpConnection(self.core, handshake_timeout=2.0), "127.0.0.1", self.port
        )
        self.port = self.server.sockets[0].getsockname()[1]
        # STOMP on the same core, for the tests of what crosses between the protocols.
        self.stomp_server = await loop.create_server(
            lambda: StompConnection(self.core), "127.0.0.1", self.stomp_port
        )
        self.stomp_port = self.stomp_server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def stop() -> None:
            self.server.close()
            self.stomp_server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            self.core.stop()
            await self.store.close()

        self.run(stop())

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.port}"

    def connect(self, **kwargs: Any) -> BlockingConnection:
        kwargs.setdefault("user", "admin")
        kwargs.setdefault("password", "admin")
        kwargs.setdefault("timeout", 10)
        return BlockingConnection(self.url, **kwargs)

    def waiting(self, queue: str) -> int:
        return self.call(lambda: len(self.core.engine.browse(queue)))


@pytest.fixture(scope="module")
def users() -> UsersFile:
    users = UsersFile()
    users.add("admin", "admin")
    return users


@pytest.fixture
def broker(tmp_path: Path, users: UsersFile) -> Iterator[InProcessBroker]:
    b = InProcessBroker(tmp_path, users, heartbeat=5.0)
    yield b
    b.close()


def _is_serving(b: InProcessBroker) -> None:
    """A fresh client can still send and receive: the broker survived what came before."""
    c = b.connect()
    try:
        queue = f"alive-{uuid.uuid4()}"
        c.create_sender(queue).send(Message(body="still here"))
        r = c.create_receiver(queue, credit=1)
        assert r.receive(5).body == "still here"
        r.accept()
    finally:
        c.close()


def _receive_all(r: Any, *, timeout: float = 0.5, accept: bool = True) -> list[Message]:
    out = []
    while True:
        try:
            out.append(r.receive(timeout))
        except Timeout:
            return out
        if accept:
            r.accept()


# --- a proton client driven over a socket ---------------------------------------------------


class RawClient:
    """A proton connection pumped by hand over a blocking socket (sans-IO, no reactor)."""

    def __init__(
        self,
        port: int,
        *,
        user: str | None = "admin",
        password: str | None = "admin",
        idle_timeout: float | None = None,
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.connection = Connection()
        self.collector = Collector()
        self.connection.collect(self.collector)
        self.transport = Transport()
        if idle_timeout is not None:
            self.transport.idle_timeout = idle_timeout
        if user is not None:
            sasl = self.transport.sasl()
            sasl.allowed_mechs("PLAIN")
            sasl.allow_insecure_mechs = True
            self.connection.user = user
            self.connection.password = password  # type: ignore[assignment] # None: no password
        self.transport.bind(self.connection)
        self.connection.hostname = "localhost"
        self.connection.open()
        self.session = self.connection.session()
        self.session.open()
        self.received: dict[Link, list[tuple[Delivery, Message]]] = {}
        self.eof = False
        self._tags = 0

    def pump(self, until: Callable[[], bool] = lambda: False, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._events()
            self._write()
            if until():
                return
            if self.eof:
                raise ConnectionError("the broker closed the connection")
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached")
            readable, _, _ = select.select([self.sock], [], [], 0.02)
            capacity = self.transport.capacity()
            if readable and capacity > 0:
                try:
                    data = self.sock.recv(min(capacity, 65536))
                except ConnectionResetError:
                    data = b""
                if data:
                    self.transport.push(data)
                else:
                    self.eof = True
                    self.transport.close_tail()
            self.transport.tick(time.monotonic())

    def _events(self) -> None:
        while (event := self.collector.peek()) is not None:
            if event.type is Event.DELIVERY:
                delivery = event.delivery
                assert delivery is not None
                link = delivery.link
                if link.is_receiver and delivery.readable and not delivery.partial:
                    message = Message()
                    message.decode(link.recv(delivery.pending) or b"")
                    link.advance()
                    self.received.setdefault(link, []).append((delivery, message))
            self.collector.pop()

    def _write(self) -> None:
        while (pending := self.transport.pending()) > 0:
            self.sock.sendall(self.transport.peek(pending) or b"")
            self.transport.pop(pending)

    def open_link(self, link: Link) -> Link:
        link.open()
        self.pump(lambda: bool(link.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED)))
        return link

    def sender(self, address: str | None) -> Sender:
        sender = self.session.sender(f"sender-{uuid.uuid4()}")
        sender.target.address = address  # type: ignore[assignment] # None: anonymous relay
        self.open_link(sender)
        return sender

    def receiver(self, address: str | None, *, credit: int = 0, dynamic: bool = False) -> Receiver:
        receiver = self.session.receiver(f"receiver-{uuid.uuid4()}")
        if dynamic:
            receiver.source.dynamic = True
        else:
            receiver.source.address = address  # type: ignore[assignment] # None: dynamic
        self.open_link(receiver)
        if credit:
            receiver.flow(credit)
        return receiver

    def coordinator(self) -> Sender:
        link = self.session.sender(f"txn-{uuid.uuid4()}")
        link.target.type = Terminus.COORDINATOR
        link.target.capabilities.put_object(
            Array(UNDESCRIBED, Data.SYMBOL, symbol("amqp:local-transactions"))  # type: ignore[arg-type]
        )
        return self.open_link(link)  # type: ignore[return-value]

    def send(self, sender: Sender, message: Message, *, txn_id: bytes | None = None) -> Delivery:
        self._tags += 1
        delivery = sender.delivery(str(self._tags))
        if txn_id is not None:
            delivery.local.data = [txn_id]  # type: ignore[list-item]
            delivery.update(0x34)
        sender.send(message.encode())
        sender.advance()
        return delivery

    def settled(self, delivery: Delivery, timeout: float = 10.0) -> Delivery:
        self.pump(lambda: delivery.settled, timeout)
        return delivery

    def declare(self, coordinator: Sender) -> bytes:
        delivery = self.settled(
            self.send(coordinator, Message(body=Described(symbol("amqp:declare:list"), [None])))
        )
        assert delivery.remote_state == 0x33, delivery.remote_state
        data = delivery.remote.data
        assert data is not None
        txn_id = data[0]
        assert isinstance(txn_id, bytes | memoryview)
        return bytes(txn_id)

    def discharge(self, coordinator: Sender, txn_id: bytes, *, fail: bool) -> Delivery:
        body = Described(symbol("amqp:discharge:list"), [txn_id, fail])
        return self.settled(self.send(coordinator, Message(body=body)))

    def messages(self, receiver: Receiver, count: int, timeout: float = 10.0) -> list[Message]:
        self.pump(lambda: len(self.received.get(receiver, [])) >= count, timeout)
        return [m for _, m in self.received[receiver]]

    def close(self) -> None:
        try:
            if not self.eof:
                self.connection.close()
                self.pump(lambda: bool(self.connection.state & Endpoint.REMOTE_CLOSED), 5)
        except (ConnectionError, TimeoutError, OSError):
            pass
        finally:
            self.sock.close()


@pytest.fixture
def raw(broker: InProcessBroker) -> Iterator[Callable[..., RawClient]]:
    clients: list[RawClient] = []

    def make(**kwargs: Any) -> RawClient:
        client = RawClient(broker.port, **kwargs)
        clients.append(client)
        client.pump(lambda: bool(client.connection.state & Endpoint.REMOTE_ACTIVE))
        return client

    yield make
    for client in clients:
        client.close()


# --- messaging ------------------------------------------------------------------------------


def test_round_trip_on_a_queue_keeps_the_message(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        sender = c.create_sender("orders")
        sent = [
            Message(
                body="text",
                id="id-1",
                durable=True,
                priority=7,
                properties={"colour": "red", "count": 3, "flag": True},
                reply_to="queue://replies",
                correlation_id="corr-1",
                subject="subj",
                content_type="text/plain",
            ),
            Message(body=b"\x00\x01bytes", id=uuid.UUID(int=5)),
            Message(body={"k": [1, 2.5, None]}),
            Message(body=None),
        ]
        for message in sent:
            sender.send(message)
        r = c.create_receiver("queue://orders", credit=10)
        got: list[Any] = [r.receive(5) for _ in sent]
        r.accept()
        first = got[0]
        assert first.body == "text"
        assert first.id == "id-1"
        assert first.durable
        assert first.priority == 7
        assert first.properties == {"colour": "red", "count": "3", "flag": "true"}
        assert (first.reply_to, first.correlation_id, first.subject) == (
            "queue://replies",
            "corr-1",
            "subj",
        )
        assert first.content_type == "text/plain"
        assert first.address == "queue://orders"
        assert first.delivery_count == 0
        assert first.first_acquirer
        assert bytes(got[1].body) == b"\x00\x01bytes"
        assert got[1].id == str(uuid.UUID(int=5))
        assert got[2].body == {"k": [1, 2.5, None]}
        assert got[3].body is None
        assert got[3].id.startswith("live:")  # the broker's id when the producer gave none
    finally:
        c.close()


@pytest.mark.parametrize("address", ["jobs", "queue://jobs", "/queue/jobs"])
def test_address_forms_name_the_same_queue(broker: InProcessBroker, address: str) -> None:
    c = broker.connect()
    try:
        c.create_sender(address).send(Message(body=address))
        assert broker.waiting("queue://jobs") == 1
        r = c.create_receiver("jobs", credit=1)
        assert r.receive(5).body == address
        r.accept()
    finally:
        c.close()


def test_competing_consumers_share_a_queue(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        receivers = [c.create_receiver("work", credit=100, name=f"w{i}") for i in range(2)]
        sender = c.create_sender("work")
        for i in range(20):
            sender.send(Message(body=i))
        got: list[list[Any]] = [[m.body for m in _receive_all(r)] for r in receivers]
        assert sorted(got[0] + got[1]) == list(range(20))
        assert got[0]
        assert got[1]
    finally:
        c.close()


def test_topic_fans_out_to_every_receiver(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        receivers = [
            c.create_receiver("topic://prices", credit=100, name=f"p{i}") for i in range(2)
        ]
        sender = c.create_sender("topic://prices")
        for i in range(10):
            sender.send(Message(body=i))
        for r in receivers:
            assert [m.body for m in _receive_all(r)] == list(range(10))
    finally:
        c.close()


def test_persistent_messages_survive_a_restart(broker: InProcessBroker) -> None:
    c = broker.connect()
    sender = c.create_sender("keep")
    for i in range(5):
        sender.send(Message(body=f"p{i}", durable=True, id=f"p{i}"))
    sender.send(Message(body="transient"))
    c.close()
    broker.stop()
    broker.start()  # same port, journal recovered
    c = broker.connect()
    try:
        r = c.create_receiver("keep", credit=10)
        got = _receive_all(r)
        assert [m.body for m in got] == [f"p{i}" for i in range(5)]
        assert all(not m.first_acquirer for m in got)  # may have been seen before the crash
    finally:
        c.close()


def test_a_durable_message_id_is_a_duplicate_id_when_the_broker_says_so(
    tmp_path: Path, users: UsersFile
) -> None:
    # By default only _AMQ_DUPL_ID is (tests/broker/test_amqp_duplicate_id.py).
    broker = InProcessBroker(tmp_path, users, heartbeat=5.0, amqp_message_id_duplicates=True)
    c = broker.connect()
    try:
        sender = c.create_sender("dedup")
        for _ in range(3):  # a client resending after an unknown outcome
            sender.send(Message(body="once", durable=True, id="same-id"))
        sender.send(Message(body="also once", properties={"_AMQ_DUPL_ID": "x"}, durable=True))
        sender.send(Message(body="also once", properties={"_AMQ_DUPL_ID": "x"}, durable=True))
        r = c.create_receiver("dedup", credit=10)
        got = _receive_all(r)
        assert [m.body for m in got] == ["once", "also once"]
        # Delivered with it, as on Artemis: the one id that is the same on every node.
        assert got[1].properties == {"_AMQ_DUPL_ID": "x"}
    finally:
        c.close()
        broker.close()


def test_release_reject_and_modify(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        c.create_sender("outcomes").send(Message(body="m"))
        r = c.create_receiver("outcomes", credit=1)
        assert r.receive(5).delivery_count == 0
        r.release(delivered=False)  # released: not a failed attempt
        m = r.receive(5)
        assert (m.delivery_count, m.first_acquirer) == (0, False)
        assert r.fetcher is not None
        r.fetcher.unsettled[0].local.failed = True
        r.settle(Delivery.MODIFIED)  # modified(delivery-failed): one failed attempt
        assert r.receive(5).delivery_count == 1
        r.reject()
        assert _receive_all(r) == []
        dlq = c.create_receiver("queue://DLQ", credit=1)
        dead: Any = dlq.receive(5)
        assert dead.body == "m"
        assert dead.properties["_AMQ_ORIG_ADDRESS"] == "queue://outcomes"
        dlq.accept()
    finally:
        c.close()


def test_pre_settled_links_send_and_consume_at_most_once(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        sender = c.create_sender("fast", options=AtMostOnce())
        for i in range(5):
            sender.send(Message(body=i))
        r = c.create_receiver("fast", credit=10, options=AtMostOnce())
        assert [r.receive(5).body for _ in range(5)] == list(range(5))
        # AUTO ack mode: nothing is in flight, nothing comes back on close.
        assert broker.call(lambda: broker.core.engine.stats().in_flight) == 0
    finally:
        c.close()


def test_credit_bounds_what_a_consumer_holds(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    sender = client.sender("bounded")
    for i in range(50):
        client.settled(client.send(sender, Message(body=i)))
    receiver = client.receiver("bounded", credit=7)
    assert [m.body for m in client.messages(receiver, 7)] == list(range(7))
    with pytest.raises(TimeoutError):  # room for deliveries beyond the credit, if any came
        client.pump(lambda: len(client.received[receiver]) > 7, timeout=0.3)
    assert broker.waiting("queue://bounded") == 43
    assert broker.call(lambda: broker.core.engine.stats().in_flight) == 7
    receiver.flow(3)
    assert len(client.messages(receiver, 10)) == 10


def test_a_slow_reader_pauses_its_consumers_instead_of_buffering(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    slow = raw()
    receiver = slow.receiver("flood", credit=100_000)
    # 96 MiB: far more than the write buffer's high-water mark (4 MiB) and the kernel's
    # socket buffers can hold between them.
    count, body = 1500, b"x" * 65536
    producer = raw()
    sender = producer.sender("flood")
    sender.snd_settle_mode = Link.SND_SETTLED
    producer.send(sender, Message(body=body)).settle()
    producer.pump(lambda: producer.transport.pending() == 0 and sender.queued == 0)
    slow.messages(receiver, 1)  # the broker has the credit; from here the client reads nothing
    for _ in range(count - 1):
        producer.send(sender, Message(body=body)).settle()
    producer.pump(lambda: producer.transport.pending() == 0 and sender.queued == 0, 30)

    def flood() -> Any:
        return next(q for q in broker.core.engine.stats().queues if q.name == "queue://flood")

    # The slow client reads nothing: the broker stops dispatching once its buffer is full.
    deadline = time.monotonic() + 20
    while (stats := broker.call(flood)).messages + stats.in_flight < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    stats = broker.call(flood)
    assert stats.messages > count // 3, "the broker dispatched what the client cannot read"
    # Once the client reads, the rest follows.
    slow.pump(lambda: len(slow.received.get(receiver, [])) == count, timeout=60)


def test_drain_returns_the_credit_nothing_can_use(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    sender = client.sender("drain")
    for i in range(3):
        client.settled(client.send(sender, Message(body=i)))
    receiver = client.receiver("drain")
    receiver.drain(10)
    client.pump(lambda: not receiver.draining() and len(client.received.get(receiver, [])) == 3)
    assert receiver.credit == 0
    assert [m.body for m in client.messages(receiver, 3)] == [0, 1, 2]


def test_anonymous_relay_routes_by_the_to_field(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    assert "ANONYMOUS-RELAY" in [str(s) for s in client.connection.remote_offered_capabilities]
    relay = client.sender(None)
    ok = client.settled(client.send(relay, Message(address="queue://a", body="to a")))
    assert ok.remote_state == Delivery.ACCEPTED
    bad = client.settled(client.send(relay, Message(body="nowhere")))
    assert bad.remote_state == Delivery.REJECTED
    assert broker.waiting("queue://a") == 1


def test_queue_browser_sees_without_taking(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        sender = c.create_sender("browse")
        for i in range(3):
            sender.send(Message(body=i))
        browser = c.create_receiver("browse", credit=10, options=Copy())
        assert [m.body for m in _receive_all(browser, accept=False)] == [0, 1, 2]
        assert broker.waiting("queue://browse") == 3
    finally:
        c.close()


def test_durable_subscription_keeps_messages_while_detached(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()

    def subscriber() -> Receiver:
        receiver = client.session.receiver("sub-1")
        receiver.source.address = "topic://news"
        receiver.source.durability = Terminus.DELIVERIES
        receiver.source.expiry_policy = Terminus.EXPIRE_NEVER
        client.open_link(receiver)
        return receiver

    def consumers() -> int:
        return broker.call(lambda: broker.core.engine.stats().consumers)

    first = subscriber()
    first.detach()  # detach, not close: the subscription stays
    client.pump(lambda: consumers() == 0)
    sender = client.sender("topic://news")
    client.settled(client.send(sender, Message(body="while away", durable=True)))
    again = subscriber()
    again.flow(10)
    assert [m.body for m in client.messages(again, 1)] == ["while away"]
    again.close()  # closed: the subscription is deleted
    client.pump(lambda: "topic://news::sub-1" not in broker.call(broker.core.engine.queues))


def test_expired_messages_are_not_delivered(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        sender = c.create_sender("ttl")
        sender.send(Message(body="short", ttl=0.05))
        sender.send(Message(body="long", ttl=60))
        time.sleep(0.2)
        r = c.create_receiver("ttl", credit=10)
        got: list[Any] = _receive_all(r)
        assert [m.body for m in got] == ["long"]
        assert 0 < got[0].ttl <= 60
        assert got[0].expiry_time > time.time()
    finally:
        c.close()


def test_higher_priority_first(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        sender = c.create_sender("prio")
        for body, priority in (("low", 1), ("high", 9), ("default", 4), ("over", 200)):
            sender.send(Message(body=body, priority=priority))
        r = c.create_receiver("prio", credit=10)
        assert [m.body for m in _receive_all(r)] == ["high", "over", "default", "low"]
    finally:
        c.close()


def test_messages_cross_between_stomp_and_amqp(broker: InProcessBroker) -> None:
    stomp = WireClient(broker.stomp_port)
    c = broker.connect()
    try:
        assert stomp.connect().command == "CONNECTED"  # the same users file
        stomp.send(
            "SEND",
            {
                "destination": "/queue/mixed",
                "persistent": "true",
                "reply-to": "/queue/answers",
                "correlation-id": "c-7",
                "colour": "blue",
                "receipt": "r1",
            },
            b"from stomp",
        )
        assert stomp.receive().command == "RECEIPT"
        r = c.create_receiver("queue://mixed", credit=1)
        m: Any = r.receive(5)
        r.accept()
        assert bytes(m.body) == b"from stomp"  # STOMP bodies are bytes: a data section
        assert (m.durable, m.reply_to, m.correlation_id) == (True, "/queue/answers", "c-7")
        assert m.properties["colour"] == "blue"

        c.create_sender("/queue/back").send(
            Message(body="from amqp", properties={"k": "v"}, content_type="text/plain")
        )
        stomp.send("SUBSCRIBE", {"id": "s1", "destination": "/queue/back", "ack": "auto"})
        frame = stomp.receive()
        assert frame.command == "MESSAGE"
        assert frame.body == b"from amqp"
        assert frame.get("k") == "v"
        assert frame.get("content-type") == "text/plain"
    finally:
        c.close()
        stomp.sock.close()


# --- temporary queues -----------------------------------------------------------------------


def test_dynamic_source_is_a_temporary_queue_for_replies(broker: InProcessBroker) -> None:
    requester = broker.connect()
    responder = broker.connect()
    try:
        replies = requester.create_receiver(None, dynamic=True, credit=10)
        reply_to = replies.link.remote_source.address
        assert reply_to is not None
        assert reply_to.startswith("temp-queue://")
        requester.create_sender("requests").send(Message(body="ping", reply_to=reply_to))
        incoming = responder.create_receiver("requests", credit=1)
        request = incoming.receive(5)
        incoming.accept()
        responder.create_sender(request.reply_to).send(Message(body="pong", correlation_id="c1"))
        reply = replies.receive(5)
        assert (reply.body, reply.correlation_id) == ("pong", "c1")
        replies.accept()
        replies.close()  # type: ignore[no-untyped-call] # the queue goes with its link
        assert reply_to not in broker.call(lambda: broker.core.engine.queues())
        with pytest.raises(LinkDetached, match="amqp:not-found"):
            responder.create_receiver(reply_to)
    finally:
        requester.close()
        responder.close()


def test_a_temporary_queue_is_its_owners_only(broker: InProcessBroker) -> None:
    owner = broker.connect()
    other = broker.connect()
    try:
        replies = owner.create_receiver(None, dynamic=True)
        address = replies.link.remote_source.address
        with pytest.raises(LinkDetached, match="amqp:resource-locked"):
            other.create_receiver(address)
    finally:
        owner.close()
        other.close()
    assert not [q for q in broker.call(lambda: broker.core.engine.queues()) if "temp" in q]


# --- transactions ---------------------------------------------------------------------------


def test_commit_makes_sends_visible_and_rollback_discards_them(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    coordinator = client.coordinator()
    assert coordinator.remote_target.type == Terminus.COORDINATOR
    sender = client.sender("txq")
    txn = client.declare(coordinator)
    for i in range(3):
        sent = client.settled(client.send(sender, Message(body=i, durable=True), txn_id=txn))
        assert sent.remote_state == 0x34  # transactional-state(accepted)
    assert broker.waiting("queue://txq") == 0  # held until commit
    assert client.discharge(coordinator, txn, fail=False).remote_state == Delivery.ACCEPTED
    assert broker.waiting("queue://txq") == 3
    txn = client.declare(coordinator)
    client.settled(client.send(sender, Message(body="never"), txn_id=txn))
    assert client.discharge(coordinator, txn, fail=True).remote_state == Delivery.ACCEPTED
    assert broker.waiting("queue://txq") == 3
    # A discharged transaction is gone: discharging it again is rejected.
    again = client.discharge(coordinator, txn, fail=False)
    assert again.remote_state == Delivery.REJECTED
    condition = again.remote.condition
    assert condition is not None
    assert condition.name == "amqp:transaction:unknown-id"


def test_transactional_acks_commit_or_come_back(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    sender = client.sender("txacks")
    for i in range(2):
        client.settled(client.send(sender, Message(body=i, durable=True)))
    coordinator = client.coordinator()
    receiver = client.receiver("txacks", credit=10)
    client.messages(receiver, 2)

    def accept_all(txn: bytes) -> None:
        for delivery, _ in client.received.pop(receiver):
            delivery.local.data = [txn, Described(ulong(0x24), [])]  # type: ignore[list-item]
            delivery.update(0x34)
            delivery.settle()

    txn = client.declare(coordinator)
    accept_all(txn)
    client.discharge(coordinator, txn, fail=True)
    redelivered = client.messages(receiver, 2)  # rolled back: delivered again
    assert [(m.body, m.delivery_count) for m in redelivered] == [(0, 1), (1, 1)]
    txn = client.declare(coordinator)
    accept_all(txn)
    client.discharge(coordinator, txn, fail=False)
    assert broker.call(lambda: broker.core.engine.stats().messages) == 0
    assert broker.call(lambda: broker.core.engine.stats().in_flight) == 0


def test_closing_the_coordinator_rolls_back_its_transactions(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    coordinator = client.coordinator()
    txn = client.declare(coordinator)
    client.settled(client.send(client.sender("orphan"), Message(body="x"), txn_id=txn))
    assert broker.call(lambda: broker.core.engine.stats().transactions) == 1
    coordinator.close()
    client.pump(lambda: broker.call(lambda: broker.core.engine.stats().transactions) == 0)
    assert broker.waiting("queue://orphan") == 0


def test_a_transaction_of_another_connection_is_unknown(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    owner, other = raw(), raw()
    txn = owner.declare(owner.coordinator())
    sender = other.sender("stolen")
    delivery = other.settled(other.send(sender, Message(body="x"), txn_id=txn))
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition.name == "amqp:transaction:unknown-id"  # type: ignore[union-attr]


def test_distributed_transactions_are_refused(raw: Callable[..., RawClient]) -> None:
    client = raw()
    coordinator = client.coordinator()
    body = Described(symbol("amqp:declare:list"), [b"global-id"])
    delivery = client.settled(client.send(coordinator, Message(body=body)))
    assert delivery.remote_state == Delivery.REJECTED
    assert delivery.remote.condition.name == "amqp:not-implemented"  # type: ignore[union-attr]


# --- connection properties and heart-beats ----------------------------------------------------


def test_the_open_announces_the_topology(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        assert c.conn is not None
        properties = c.conn.remote_properties
        assert properties[TOPOLOGY_PROPERTY] == list(TOPOLOGY)
        assert c.conn.remote_container == "live"
    finally:
        c.close()


def test_a_silent_client_is_closed_after_the_idle_timeout(tmp_path: Path, users: UsersFile) -> None:
    b = InProcessBroker(tmp_path, users, heartbeat=0.2)
    try:
        client = RawClient(b.port)
        client.pump(lambda: bool(client.connection.state & Endpoint.REMOTE_ACTIVE))
        # proton announces half its idle timeout (2 x heartbeat): the client should send
        # a frame every 0.2 s and is closed after 0.4 s of silence.
        assert client.transport.remote_idle_timeout == pytest.approx(0.2)
        # Stop talking: no more pumping (so no heart-beats) for well over 0.4 s.
        time.sleep(1.5)
        client.transport.push(_read_until_closed(client.sock))
        client._events()
        condition = client.connection.remote_condition
        assert condition is not None
        assert condition.name == "amqp:resource-limit-exceeded"
        client.sock.close()
        _is_serving(b)
    finally:
        b.close()


def test_a_client_that_pumps_keeps_its_connection(tmp_path: Path, users: UsersFile) -> None:
    b = InProcessBroker(tmp_path, users, heartbeat=0.2)
    try:
        c = b.connect()
        r = c.create_receiver("idle", credit=1)
        with pytest.raises(Timeout):
            r.receive(1.5)  # the client's container sends heart-beats while it waits
        c.create_sender("idle").send(Message(body="after"))
        assert r.receive(5).body == "after"
        r.accept()
        c.close()
    finally:
        b.close()


def test_the_broker_heart_beats_to_a_client_that_asks(raw: Callable[..., RawClient]) -> None:
    client = raw(idle_timeout=0.4)  # the client closes if the broker is silent for 0.4 s
    with pytest.raises(TimeoutError):  # nothing happens but heart-beats
        client.pump(lambda: client.connection.state & Endpoint.LOCAL_ACTIVE == 0, timeout=1.5)
    assert client.connection.state & Endpoint.REMOTE_ACTIVE
    assert client.transport.condition is None


# --- security -------------------------------------------------------------------------------


def test_a_wrong_password_is_refused(broker: InProcessBroker, caplog: Any) -> None:
    with pytest.raises(ConnectionException, match="unauthorized-access"):
        broker.connect(password="wrong")
    assert "authentication failed for user 'admin'" in caplog.text
    _is_serving(broker)


def test_an_unknown_user_is_refused(broker: InProcessBroker) -> None:
    with pytest.raises(ConnectionException, match="unauthorized-access"):
        broker.connect(user="nobody", password="admin")


def test_no_credentials_are_refused(broker: InProcessBroker) -> None:
    # proton offers ANONYMOUS without credentials; the broker offers only PLAIN.
    with pytest.raises(ConnectionException):
        BlockingConnection(broker.url, timeout=10)


def test_anonymous_mechanism_is_refused_by_default(broker: InProcessBroker) -> None:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        s.sendall(SASL_HEADER)
        s.sendall(encode_sasl_frame(SASL_INIT, [symbol("ANONYMOUS"), b"", None]))
        data = _read_until_closed(s)
    assert _sasl_outcome(data) == 1  # auth


def test_skipping_sasl_is_refused_with_a_reason(broker: InProcessBroker) -> None:
    with pytest.raises(ConnectionException, match="authentication required"):
        BlockingConnection(broker.url, timeout=10, sasl_enabled=False)


def test_anonymous_clients_when_allowed(tmp_path: Path, users: UsersFile) -> None:
    b = InProcessBroker(tmp_path, users, allow_anonymous=True)
    try:
        for sasl_enabled in (True, False):
            c = BlockingConnection(b.url, timeout=10, sasl_enabled=sasl_enabled)
            c.create_sender("anon").send(Message(body="hi"))
            c.close()
        assert b.waiting("queue://anon") == 2
        c = b.connect()  # PLAIN still works
        c.close()
    finally:
        b.close()


def test_a_node_that_may_not_serve_refuses_connections(broker: InProcessBroker) -> None:
    broker.core.may_serve = lambda: False
    with pytest.raises(ConnectionException, match="not active"):
        broker.connect()


# --- malformed input ------------------------------------------------------------------------


def _read_until_closed(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _sasl_frames(data: bytes) -> list[Any] | None:
    """The SASL performatives the broker wrote after its header; None while one is partial."""
    assert data[:8] == SASL_HEADER[: len(data[:8])]
    frames, out = data[8:], []
    while frames:
        size = int.from_bytes(frames[:4], "big")
        if len(frames) < 8 or len(frames) < size:
            return None
        body = Data()
        body.decode(frames[8:size])
        body.rewind()
        body.next()
        out.append(body.get_object())
        frames = frames[size:]
    return out


def _sasl_outcome(data: bytes) -> int:
    """The code of the sasl-outcome the broker wrote, or -1 if it wrote none."""
    assert data.startswith(SASL_HEADER)
    frames = _sasl_frames(data)
    assert frames is not None
    codes = [int(f.value[0]) for f in frames if f.descriptor == 0x44]
    return codes[-1] if codes else -1


def _authenticated_socket(port: int) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(SASL_HEADER + encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), b"\0admin\0admin"]))
    data = b""
    while len(data) < 8 or (frames := _sasl_frames(data)) is None or len(frames) < 2:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed during SASL")
        data += chunk
    assert _sasl_outcome(data) == 0
    return s, data


def test_garbage_instead_of_a_header_gets_our_header_and_a_close(
    broker: InProcessBroker,
) -> None:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_until_closed(s) == SASL_HEADER
    _is_serving(broker)


def test_a_bad_sasl_frame_gets_an_error_outcome_and_a_close(broker: InProcessBroker) -> None:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        s.sendall(SASL_HEADER + b"\x00\x00\x00\x0c\x02\x01\x00\x00\xde\xad\xbe\xef")
        assert _sasl_outcome(_read_until_closed(s)) == 3  # sys-perm
    _is_serving(broker)


def test_a_truncated_sasl_frame_is_closed(broker: InProcessBroker) -> None:
    frame = encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), b"\0admin\0admin"])
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        s.sendall(SASL_HEADER + frame[: len(frame) // 2])
        s.shutdown(socket.SHUT_WR)
        data = _read_until_closed(s)
    assert _sasl_outcome(data) == -1  # mechanisms only: nothing was authenticated
    _is_serving(broker)


def test_a_silent_socket_is_closed_after_the_handshake_timeout(broker: InProcessBroker) -> None:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        started = time.monotonic()
        assert _read_until_closed(s) == b""
        assert 1.5 < time.monotonic() - started < 4.5


def test_garbage_after_sasl_closes_with_a_framing_error(broker: InProcessBroker) -> None:
    s, _ = _authenticated_socket(broker.port)
    with s:
        s.sendall(AMQP_HEADER + b"\x00\x00\x00\x08\x09\x00\x00\x00garbage-garbage")
        data = _read_until_closed(s)
    transport, connection = _decode_server_output(data)
    condition = transport.condition or connection.remote_condition
    assert condition is not None
    assert condition.name in ("amqp:connection:framing-error", "amqp:decode-error")
    _is_serving(broker)


def test_a_truncated_amqp_frame_is_closed(broker: InProcessBroker) -> None:
    s, _ = _authenticated_socket(broker.port)
    with s:
        s.sendall(AMQP_HEADER + b"\x00\x00\x01\x00\x02\x00\x00\x00\x00\x53\x10")
        s.shutdown(socket.SHUT_WR)
        data = _read_until_closed(s)
    # proton's header, then the close: without an Open there is no Close frame to send.
    assert data == AMQP_HEADER
    _is_serving(broker)


def _decode_server_output(data: bytes) -> tuple[Transport, Connection]:
    """Feed what the broker wrote into a client transport, to read its close condition."""
    transport = Transport()
    connection = Connection()
    transport.bind(connection)
    connection.open()
    transport.pending()
    # Only what followed our SASL exchange: the AMQP header and frames.
    index = data.find(AMQP_HEADER)
    assert index >= 0
    transport.push(data[index:])
    return transport, connection


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(junk=st.binary(min_size=1, max_size=200))
def test_any_bytes_after_sasl_never_hurt_the_broker(broker: InProcessBroker, junk: bytes) -> None:
    s, _ = _authenticated_socket(broker.port)
    with s:
        s.sendall(AMQP_HEADER + junk)
        s.shutdown(socket.SHUT_WR)
        _read_until_closed(s)
    _is_serving(broker)


# --- errors on links ------------------------------------------------------------------------


def test_a_bad_address_rejects_the_transfer_with_the_reason(
    broker: InProcessBroker, raw: Callable[..., RawClient]
) -> None:
    client = raw()
    sender = client.sender("queue://bad::name")
    rejected = client.settled(client.send(sender, Message(body="x")))
    assert rejected.remote_state == Delivery.REJECTED
    condition = rejected.remote.condition
    assert condition is not None
    assert condition.name == "amqp:invalid-field"
    assert "reserved" in str(condition.description)
    # The link stays usable: the error was about that one message.
    assert client.settled(client.send(sender, Message(body="y"))).remote_state == (
        Delivery.REJECTED
    )
    good = client.sender("good")
    assert client.settled(client.send(good, Message(body="z"))).remote_state == Delivery.ACCEPTED
    c = broker.connect()
    try:
        with pytest.raises(SendException) as raised:
            c.create_sender("queue://bad::name").send(Message(body="x"))
        assert raised.value.state == Delivery.REJECTED
    finally:
        c.close()
    _is_serving(broker)


def test_an_unknown_temporary_queue_refuses_the_link(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        with pytest.raises(LinkDetached, match="amqp:not-found"):
            c.create_receiver("temp-queue://nobody-1")
    finally:
        c.close()


def test_selectors_are_refused_as_not_implemented(broker: InProcessBroker) -> None:
    c = broker.connect()
    try:
        with pytest.raises(LinkDetached, match="amqp:not-implemented"):
            c.create_receiver("orders", options=Selector("colour = 'red'"))
        _is_serving(broker)
    finally:
        c.close()


def test_condition_carries_the_broker_code(raw: Callable[..., RawClient]) -> None:
    client = raw()
    receiver = client.session.receiver("r")
    receiver.source.address = "temp-queue://missing-9"
    receiver.open()
    client.pump(lambda: bool(receiver.state & Endpoint.REMOTE_CLOSED))
    condition = receiver.remote_condition
    assert isinstance(condition, Condition)
    assert condition.name == "amqp:not-found"
    info: Any = condition.info
    assert info[symbol("hafailover-code")] == "ADDRESS_NOT_FOUND"
    assert "temp-queue://missing-9" in str(condition.description)


# --- failover with a real pair ----------------------------------------------------------------


class PipelinedSender:
    """Sends persistent messages with up to `window` unsettled, recording confirmations."""

    def __init__(
        self,
        client: RawClient,
        sender: Sender,
        window: int,
        on_confirmed: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.client = client
        self.sender = sender
        self.window = window
        self.on_confirmed = on_confirmed
        self.unsettled: list[tuple[Delivery, str]] = []
        self.confirmed: list[str] = []
        self.rejected = 0

    def send_all(self, bodies: list[str], timeout: float) -> None:
        queue = list(reversed(bodies))
        deadline = time.monotonic() + timeout
        while queue or self.unsettled:
            while queue and len(self.unsettled) < self.window and self.sender.credit > 0:
                body = queue.pop()
                message = Message(body=body, durable=True, id=body)
                self.unsettled.append((self.client.send(self.sender, message), body))
            self.client.pump(lambda: self.unsettled[0][0].settled, timeout=10)
            keep = []
            for delivery, body in self.unsettled:
                if delivery.settled:
                    if delivery.remote_state == Delivery.ACCEPTED:
                        self.confirmed.append(body)
                    else:
                        self.rejected += 1
                    delivery.settle()
                else:
                    keep.append((delivery, body))
            self.unsettled = keep
            self.on_confirmed(len(self.confirmed))
            assert time.monotonic() < deadline, "sending took too long"


def _consume_all(node: Any, address: str) -> list[str]:
    c = BlockingConnection(
        f"amqp://127.0.0.1:{node.amqp_port}", user="admin", password="admin", timeout=30
    )
    try:
        r = c.create_receiver(address, credit=1000)
        return [str(m.body) for m in _receive_all(r, timeout=2.0)]
    finally:
        c.close()


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_ten_thousand_confirmed_sends_survive_a_sigkill_then_failback_and_again(
    tmp_path: Path,
) -> None:
    count = 10_000
    # The kills decide the takeovers here: a 3 s heart-beat timeout (a 4.5 s lease), not
    # 1 s, which a loaded machine once starved the live past before any kill (a takeover
    # the test's raw client saw as a broken pipe).
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=3.0) as pair:
        original = pair.live
        for cycle in range(2):
            live = pair.live
            assert live is original
            client = RawClient(live.amqp_port)
            client.pump(lambda c=client: bool(c.connection.state & Endpoint.REMOTE_ACTIVE))
            topology = client.connection.remote_properties[TOPOLOGY_PROPERTY]
            assert topology == [f"127.0.0.1:{n.amqp_port}" for n in (live, pair.backup)]
            address = f"queue://failover-{cycle}"
            sender = client.sender(address)
            pipeline = PipelinedSender(client, sender, window=500)
            bodies = [f"m-{i:05d}" for i in range(count)]
            pipeline.send_all(bodies, timeout=180)
            assert (len(pipeline.confirmed), pipeline.rejected) == (count, 0)
            client.sock.close()

            pair.kill(live)
            survivor = pair.wait_active(30)
            assert survivor is not live
            received = _consume_all(survivor, address)
            lost = set(bodies) - set(received)
            assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
            assert len(received) == count  # no duplicates either
            assert received == sorted(received)  # in the order they were sent

            # Failback: the restarted live synchronizes, then takes its role back.
            pair.restart(live)
            deadline = time.monotonic() + 30
            while pair.live is not original and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pair.live is original
            pair.wait_synchronized(30)


@pytest.mark.broker
@pytest.mark.timeout(240)
def test_a_sigkill_mid_stream_loses_no_confirmed_send(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=1.0) as pair:
        live = pair.live
        client = RawClient(live.amqp_port)
        client.pump(lambda: bool(client.connection.state & Endpoint.REMOTE_ACTIVE))
        sender = client.sender("queue://midstream")

        def kill_at_half(confirmed: int) -> None:
            if confirmed >= 2_500 and live.running:
                pair.kill(live)  # with ~500 sends unsettled in flight

        pipeline = PipelinedSender(client, sender, window=500, on_confirmed=kill_at_half)
        bodies = [f"m-{i:05d}" for i in range(5_000)]
        with pytest.raises(ConnectionError):
            pipeline.send_all(bodies, timeout=180)
        client.sock.close()
        assert 2_500 <= len(pipeline.confirmed) < 5_000
        received = _consume_all(pair.wait_active(30), "queue://midstream")
    lost = set(pipeline.confirmed) - set(received)
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
    assert len(received) == len(set(received))
