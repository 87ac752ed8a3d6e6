"""RabbitMQ smoke tests with the raw clients (stomp.py, proton), not hafailover.

They prove the broker set-up (scripts/rabbitmq.sh) and pin down what RabbitMQ 3.10 from Debian
accepts, so that failures of hafailover's own interop tests can be told apart from set-up ones:

- STOMP 1.2: the ``host`` header is RabbitMQ's virtual host, so it must be ``/`` (stomp.py sends
  the host name it connected to unless given ``vhost``, and RabbitMQ then refuses the CONNECT);
  ``/queue/<name>`` declares a durable queue.
- AMQP 1.0 (same port as AMQP 0-9-1): ``/queue/<name>`` declares a queue (not durable: it is gone
  after a broker restart) and works as target and source; ``/amq/queue/<name>`` works only for a
  queue that exists (for a missing one the attach is never answered). SASL PLAIN with guest/guest
  works with proton's PyPI wheel, which has no Cyrus SASL: proton's built-in client mechanisms
  are ANONYMOUS, PLAIN and EXTERNAL.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING

import pytest
import stomp
from proton import ConnectionException, Delivery, Message, Timeout
from proton.utils import BlockingConnection
from stomp.exception import ConnectFailedException

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.interop.conftest import RabbitMQ

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60, func_only=True)]

COUNT = 100
# Queues made by STOMP here delete themselves two minutes after their last use. The arguments
# must be the same on every SEND and SUBSCRIBE that declares the queue, or RabbitMQ refuses it.
STOMP_QUEUE_ARGS = {"x-expires": "120000"}


def _unique(prefix: str) -> str:
    return f"hafailover-interop-{prefix}-{uuid.uuid4().hex[:12]}"


class _Collector(stomp.ConnectionListener):
    """Records receipts, messages and ERROR frames; lets the test thread wait for them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.receipts: set[str] = set()
        self.messages: list[stomp.utils.Frame] = []
        self.errors: list[str] = []

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        with self._cv:
            self.receipts.add(frame.headers["receipt-id"])
            self._cv.notify_all()

    def on_message(self, frame: stomp.utils.Frame) -> None:
        with self._cv:
            self.messages.append(frame)
            self._cv.notify_all()

    def on_error(self, frame: stomp.utils.Frame) -> None:
        with self._cv:
            self.errors.append(f"{frame.headers.get('message')}: {frame.body}")
            self._cv.notify_all()

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: done() or bool(self.errors), timeout)
        assert not self.errors, f"ERROR frame while waiting for {what}: {self.errors}"
        assert ok, f"timed out after {timeout}s waiting for {what}"

    def wait_for_error(self, timeout: float = 5.0) -> str:
        with self._cv:
            self._cv.wait_for(lambda: bool(self.errors), timeout)
            assert self.errors, f"no ERROR frame within {timeout}s"
            return self.errors[0]


def _stomp_connect(
    broker: RabbitMQ, listener: _Collector, password: str | None = None
) -> stomp.Connection12:
    conn = stomp.Connection12(
        [(broker.host, broker.stomp_port)],
        vhost=broker.vhost,  # the host header names RabbitMQ's virtual host
        timeout=10,
        reconnect_attempts_max=1,
        heartbeats=(0, 0),
    )
    conn.set_listener("collector", listener)
    conn.connect(broker.user, broker.password if password is None else password, wait=True)
    return conn


def _amqp_connect(broker: RabbitMQ, password: str | None = None) -> BlockingConnection:
    return BlockingConnection(
        broker.amqp_url,
        timeout=20,
        user=broker.user,
        password=broker.password if password is None else password,
        allowed_mechs="PLAIN",
        allow_insecure_mechs=True,  # PLAIN without TLS: loopback only
    )


def test_stomp_send_with_receipts_and_receive_with_client_ack(rabbitmq: RabbitMQ) -> None:
    destination = f"/queue/{_unique('stomp')}"
    bodies = [f"stomp message {i}" for i in range(COUNT)]

    listener = _Collector()
    conn = _stomp_connect(rabbitmq, listener)
    try:
        for i, body in enumerate(bodies):
            conn.send(destination, body, headers={"receipt": f"send-{i}", **STOMP_QUEUE_ARGS})
        wanted = {f"send-{i}" for i in range(COUNT)}
        listener.wait_for(lambda: wanted <= listener.receipts, f"{COUNT} send receipts")

        conn.subscribe(destination, id="sub-1", ack="client", headers=STOMP_QUEUE_ARGS)
        listener.wait_for(lambda: len(listener.messages) >= COUNT, f"{COUNT} messages")
        received = list(listener.messages)
        assert [frame.body for frame in received] == bodies
        assert {frame.headers["destination"] for frame in received} == {destination}
        assert all(frame.headers["redelivered"] == "false" for frame in received)
        for frame in received:
            conn.ack(frame.headers["ack"])  # STOMP 1.2: the MESSAGE's ack header
        conn.unsubscribe("sub-1", receipt="unsubscribed")
        listener.wait_for(lambda: "unsubscribed" in listener.receipts, "the UNSUBSCRIBE receipt")
    finally:
        conn.disconnect(receipt="bye")

    # The acks took: a new session on the same queue finds it empty (unacked messages would
    # have been requeued when the first session closed).
    again = _Collector()
    conn = _stomp_connect(rabbitmq, again)
    try:
        conn.subscribe(destination, id="sub-2", ack="client", headers=STOMP_QUEUE_ARGS)
        conn.send(destination, "marker", headers={"receipt": "marker", **STOMP_QUEUE_ARGS})
        again.wait_for(lambda: len(again.messages) >= 1, "the marker message")
        assert [frame.body for frame in again.messages] == ["marker"]
        conn.ack(again.messages[0].headers["ack"], receipt="marker-acked")
        again.wait_for(lambda: "marker-acked" in again.receipts, "the ACK receipt")
    finally:
        conn.disconnect(receipt="bye")


def test_stomp_wrong_password_is_refused(rabbitmq: RabbitMQ) -> None:
    listener = _Collector()
    with pytest.raises(ConnectFailedException):
        _stomp_connect(rabbitmq, listener, password="not-" + rabbitmq.password)
    assert "Access refused" in listener.wait_for_error()


def test_amqp_send_and_receive_on_queue_address(rabbitmq: RabbitMQ) -> None:
    address = f"/queue/{_unique('amqp')}"
    bodies = [f"amqp message {i}" for i in range(COUNT)]

    # Links are not closed one by one: RabbitMQ 3.10 answers a closing detach with a detach
    # that lacks closed=true, and proton's blocking link.close() then waits for ever (times
    # out). Closing the connection is answered properly.
    conn = _amqp_connect(rabbitmq)
    try:
        sender = conn.create_sender(address)
        for i, body in enumerate(bodies):
            # returns once the broker has settled the delivery; raises if rejected or released
            delivery = sender.send(Message(body=body, id=i, durable=True))
            assert delivery.remote_state == Delivery.ACCEPTED

        receiver = conn.create_receiver(address, credit=COUNT)
        received = []
        for _ in range(COUNT):
            received.append(receiver.receive(timeout=10).body)
            receiver.accept()
        assert received == bodies
    finally:
        conn.close()

    # The accepts took: a new connection finds the queue empty (unsettled deliveries would
    # have been requeued when the first connection closed).
    conn = _amqp_connect(rabbitmq)
    try:
        receiver = conn.create_receiver(address, credit=10)
        with pytest.raises(Timeout):
            receiver.receive(timeout=1)
    finally:
        conn.close()


def test_amqp_plain_wrong_password_is_refused(rabbitmq: RabbitMQ) -> None:
    with pytest.raises(ConnectionException, match=r"unauthorized-access.*mech=PLAIN"):
        _amqp_connect(rabbitmq, password="not-" + rabbitmq.password)
