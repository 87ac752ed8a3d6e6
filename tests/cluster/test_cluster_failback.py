"""A subscriber with ``failover_method=priority`` on the three-node RabbitMQ cluster, through
the loss and the return of its node (issue 21): what is published while that node is down
reaches it after the failover, and once the node is back the subscriber moves back to it
(priority failback), getting every message exactly once throughout.

- STOMP: a durable topic subscription (``create_durable_consumer``), whose queue RabbitMQ
  keeps on the node that declared it: a classic queue, which the client cannot ask to be a
  quorum one (RabbitMQ takes no ``x-queue-type`` on a topic subscription it names with
  ``x-queue-name``). So the operator mirrors it, a policy on the subscriptions' queues
  (``ha-mode: all``); without one, the subscription dies with its node (docs/brokers.md).
- AMQP 1.0: RabbitMQ 3.10's plugin keeps no durable topic subscription, so the subscriber
  reads a quorum queue, the cluster's durable destination.

The publisher is on node 3, the subscriber starts on node 1 (first in its URL), which is
SIGKILLed and started again. RabbitMQ detects no duplicates: the subscriber's duplicate
window (``consumer_dedup``) drops what a failover delivers again."""

from __future__ import annotations

import sys
import threading
import time
import traceback
import uuid
from collections import Counter

import pytest

import hafailover
from hafailover import AckMode, AcknowledgeFailedError, Message
from tests.integration.support import wait_until

from .conftest import RabbitMQCluster

pytestmark = [pytest.mark.cluster]

OPTIONS = "reconnect_attempts=-1&heartbeat=1s&retry_interval=100ms&max_retry_interval=1s"
SEND_PAUSE = 0.02
MIRRORED = "^hafailover-durable-"  # the policy's pattern: the subscribers' client ids


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Publisher(threading.Thread):
    """Confirmed persistent sends, numbered, until told to stop; what was confirmed when."""

    def __init__(self, url: str, destination: str) -> None:
        super().__init__(name="publisher", daemon=True)
        self.url = url
        self.destination = destination
        self.stop = threading.Event()
        self.confirmed: list[int] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                producer = connection.create_session().create_producer(self.destination)
                seq = 0
                while not self.stop.is_set():
                    producer.send(Message(body=f"m{seq}", properties={"seq": seq}))
                    self.confirmed.append(seq)
                    seq += 1
                    time.sleep(SEND_PAUSE)
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()


class Subscriber(threading.Thread):
    def __init__(self, url: str, destination: str, durable: bool) -> None:
        super().__init__(name="subscriber", daemon=True)
        self.url = url
        self.destination = destination
        self.durable = durable
        self.subscribed = threading.Event()
        self.stop = threading.Event()
        self.connection: hafailover.Connection | None = None
        self.received: list[int] = []
        self.ack_failures = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                self.connection = connection
                session = connection.create_session(AckMode.AUTO)
                if self.durable:
                    consumer = session.create_durable_consumer(self.destination, "board")
                else:
                    consumer = session.create_consumer(self.destination)
                connection.start()
                self.subscribed.set()
                while not self.stop.is_set():
                    try:
                        message = consumer.receive(0.2)
                    except AcknowledgeFailedError:
                        # F6: the last message's acknowledge was cut by the failover, so
                        # the broker may deliver it again (its id still in the duplicate
                        # window, which drops it); the application goes on receiving.
                        self.ack_failures += 1
                        continue
                    if message is not None:
                        self.received.append(int(str(message.properties["seq"])))
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()


def _node(cluster: RabbitMQCluster, subscriber: Subscriber) -> int | None:
    """The node the subscriber's connection is on; None while it fails over."""
    connection = subscriber.connection
    return None if connection is None else cluster.node_of(connection.broker)


def _where(subscriber: Subscriber) -> str:
    """What the subscriber's connection is doing, for a wait that timed out: where each
    thread is (taken first: one holding the connection's lock shows there), then the
    connection's state and failovers, read by a thread of their own so that a held lock
    cannot hang the report."""
    frames = sys._current_frames()
    stacks = [
        f"--- {thread.name}\n" + "".join(traceback.format_stack(frames[thread.ident])[-6:])
        for thread in threading.enumerate()
        if thread.ident in frames and thread is not threading.current_thread()
    ]
    read: list[str] = []
    connection = subscriber.connection
    if connection is not None:
        reader = threading.Thread(
            target=lambda: read.append(
                f"state {connection.state!r}, broker {connection.broker!r}, "
                f"reports {[report.summary() for report in connection.reports]}"
            ),
            daemon=True,
        )
        reader.start()
        reader.join(2)
    return (
        f"{read[0] if read else 'connection unreadable (its lock held for 2 s, or none)'}, "
        f"received {len(subscriber.received)}, acknowledges not confirmed (F6) "
        f"{subscriber.ack_failures}, error {subscriber.error}\n" + "\n".join(stacks)
    )


def _url(cluster: RabbitMQCluster, protocol: str, nodes: tuple[int, ...], options: str) -> str:
    brokers = ",".join(
        f"{protocol}://{cluster.user}:{cluster.password}@{cluster.host}:{cluster.port(protocol, n)}"
        for n in nodes
    )
    return f"failover:({brokers})?{OPTIONS}{options}"


@pytest.mark.timeout(240, func_only=True)
def test_a_subscriber_keeps_what_was_published_while_its_node_was_down_and_fails_back(
    cluster: RabbitMQCluster, protocol: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    if protocol == "stomp":
        cluster.ctl(
            1, "set_policy", "--apply-to", "queues", f"hafailover-mirror-{tag}", MIRRORED,
            '{"ha-mode":"all","ha-sync-mode":"automatic"}',
        )  # fmt: skip
        destination, durable = f"topic://hafailover-failback-{tag}", True
    else:
        queue = f"hafailover-failback-{tag}"
        cluster.declare_quorum_queue(queue)
        destination, durable = f"/amq/queue/{queue}", False
    try:
        _run(cluster, protocol, tag, destination, durable)
    finally:
        # The cluster keeps queues and policies across runs: removed whatever happened,
        # through node 2, which is never killed.
        if protocol == "stomp":
            cluster.ctl(2, "clear_policy", f"hafailover-mirror-{tag}")
            cluster.ctl(2, "delete_queue", f"hafailover-durable-{tag}.board")
        else:
            cluster.ctl(2, "delete_queue", queue)


def _run(
    cluster: RabbitMQCluster, protocol: str, tag: str, destination: str, durable: bool
) -> None:
    subscriber = Subscriber(
        _url(
            cluster,
            protocol,
            (1, 2, 3),
            f"&failover_method=priority&failback_interval=1s&consumer_dedup=10000"
            f"&client_id=hafailover-durable-{tag}",
        ),
        destination,
        durable,
    )
    publisher = Publisher(_url(cluster, protocol, (3, 2), ""), destination)
    try:
        subscriber.start()
        assert subscriber.subscribed.wait(30), subscriber.error
        publisher.start()
        wait_until(lambda: len(subscriber.received) >= 20, 30, "the first messages")
        assert _node(cluster, subscriber) == 1

        cluster.kill(1)
        killed_at = len(publisher.confirmed)
        wait_until(
            lambda: subscriber.error is not None or _node(cluster, subscriber) in (2, 3),
            30,
            "the subscriber on another node",
            lambda: _where(subscriber),
        )
        assert subscriber.error is None, subscriber.error
        moved_at = len(publisher.confirmed)
        # Traffic while node 1 is down (the publisher fails over too when the queue's
        # leader was there), then while it starts again.
        wait_until(lambda: len(publisher.confirmed) >= moved_at + 20, 30, "sends, node 1 down")
        down_until = len(publisher.confirmed)
        cluster.start(1)
        wait_until(
            lambda: subscriber.error is not None or _node(cluster, subscriber) == 1,
            30,
            "the subscriber back on node 1",
            lambda: _where(subscriber),
        )
        assert subscriber.error is None, subscriber.error
        sent = len(publisher.confirmed)
        wait_until(lambda: len(publisher.confirmed) >= sent + 20, 30, "sends after the failback")
    finally:
        publisher.stop.set()
        publisher.join(60)
        if publisher.error is None and subscriber.error is None:
            confirmed = set(publisher.confirmed)
            with_all = lambda: confirmed <= set(subscriber.received)  # noqa: E731
            wait_until(with_all, 30, "every confirmed message at the subscriber")
        subscriber.stop.set()
        subscriber.join(30)
    assert publisher.error is None, publisher.error
    assert subscriber.error is None, subscriber.error
    connection = subscriber.connection
    assert connection is not None
    reports = connection.reports
    duplicates = {seq: n for seq, n in Counter(subscriber.received).items() if n > 1}
    print(
        f"\n{protocol}: confirmed {len(publisher.confirmed)} (while the subscriber failed "
        f"over: {moved_at - killed_at}, while its node was down: {down_until - killed_at}), "
        f"received {len(subscriber.received)}, duplicates {len(duplicates)}, "
        f"acknowledges not confirmed (F6) {subscriber.ack_failures}, "
        f"reports {[r.summary() for r in reports]}"
    )
    assert down_until > killed_at, "nothing was published while node 1 was down"
    assert set(publisher.confirmed) <= set(subscriber.received)
    assert duplicates == {}
    # F6 reports at most the last message handed out before each failover.
    assert subscriber.ack_failures <= len(reports), subscriber.ack_failures
    assert [r.failback for r in reports][-1] is True, [r.summary() for r in reports]
    assert not any(r.failback for r in reports[:-1])
