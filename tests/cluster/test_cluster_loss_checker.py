"""The loss checker (tests/integration/test_loss_checker.py) against a three-node RabbitMQ 3.10
cluster and a quorum queue, while the node each client is connected to is SIGKILLed.

A confirmed producer (persistent sends, each waiting for the broker's confirmation: a STOMP
receipt, an AMQP settlement, which RabbitMQ gives once a majority of the queue's replicas hold
the message) and a CLIENT-acknowledge consumer run on one durable quorum queue through a
failover URL that lists the three nodes. Five times, the node each client is on is killed
(SIGKILL of its Erlang VM), the clients fail over to another node, and the killed node is
started again and rejoins the cluster before the next kill: never more than one node is down,
so the queue keeps its majority (2 of 3) all along. Every send attempted, every send confirmed
and every message received is recorded; at the end

- lost = confirmed and never received (acknowledged by the consumer, or drained after it);
- unexpected = received and never attempted;
- duplicates = seqs received more than once,

and lost and unexpected must be zero. Duplicates are allowed and reported: RabbitMQ has no
duplicate detection, so a send whose confirmation the kill swallowed is sent again (the
client resends it, ``duplicate_detection`` being on, and reports the broker's lack of it),
and a consumer's acknowledges lost with a node come again.

The producer is a confirmed one, not a transacted one: RabbitMQ 3.10 gives a STOMP commit no
such guarantee, and its AMQP 1.0 plugin has no transactions (test_cluster_transactions.py).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
import uuid
from collections import deque

import pytest

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    Connection,
    FailoverReport,
    Message,
    SendCompletion,
    StaleAcknowledgeError,
    UnblockedError,
)
from tests.integration.support import drain, seqs, wait_until

from .conftest import RabbitMQCluster

pytestmark = [pytest.mark.cluster]

OPTIONS = (
    "reconnect_attempts=-1&heartbeat=1s&retry_interval=100ms&max_retry_interval=1s"
    # RabbitMQ has no duplicate detection: the consumer's window drops the copies that the
    # client's resends and lost acknowledges bring (docs/client.md)
    "&consumer_dedup=100000"
)
# Each cycle kills and restarts one or two nodes; a restart takes 10-30 s on a loaded 2-core
# machine, so three cycles (up to six kills) keep the test well inside its guard.
CYCLES = 3
PIPELINE = 10  # sends in flight at once, so that a kill catches some unconfirmed
SEND_PAUSE = 0.004  # steady traffic rather than a flood: the machine runs three brokers
ACK_BATCH = 10
TRAFFIC_TIME = 1.0  # traffic between a node's return and the next kill


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Producer(threading.Thread):
    """Pipelined confirmed sends; a send released in doubt (UnblockedError) is sent again,
    the same Message, until confirmed: at least once."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(name="cluster-producer", daemon=True)
        self.url = url
        self.queue = queue
        self.stop = threading.Event()
        self.connection: Connection | None = None
        self.attempted: set[int] = set()
        self.confirmed: list[int] = []
        self.resends = 0  # in-doubt sends this application sent again
        self.reports: tuple[FailoverReport, ...] = ()
        self.client_resent = 0  # sends the client resent itself after a reconnect
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                self.connection = connection
                producer = connection.create_session(AckMode.AUTO).create_producer(self.queue)
                in_flight: deque[tuple[Message, SendCompletion]] = deque()
                seq = 0
                while not self.stop.is_set():
                    message = Message(body=f"m{seq}", properties={"seq": seq})
                    self.attempted.add(seq)
                    in_flight.append((message, producer.send_async(message)))
                    seq += 1
                    if len(in_flight) >= PIPELINE:
                        self._settle(producer, *in_flight.popleft())
                    time.sleep(SEND_PAUSE)
                while in_flight:
                    self._settle(producer, *in_flight.popleft())
                self.reports = connection.reports
                self.client_resent = connection.statistics().resent
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()

    def _settle(
        self, producer: hafailover.Producer, message: Message, completion: SendCompletion
    ) -> None:
        while True:
            try:
                completion.result(timeout=60)
            except UnblockedError:
                self.resends += 1
                completion = producer.send_async(message)
                continue
            self.confirmed.append(int(str(message.properties["seq"])))
            return


class Consumer(threading.Thread):
    """CLIENT acknowledge every ACK_BATCH messages, as the bundled pair's loss checker does: a
    stale acknowledge (the session failed over holding them) means the batch comes again, so
    it is not counted; an acknowledge caught by a failover leaves the batch in doubt."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(name="cluster-consumer", daemon=True)
        self.url = url
        self.queue = queue
        self.stop = threading.Event()
        self.connection: Connection | None = None
        self.handed: list[int] = []
        self.acknowledged: list[int] = []
        self.in_doubt: list[int] = []
        self.stale = 0
        self.reports: tuple[FailoverReport, ...] = ()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                self.connection = connection
                session = connection.create_session(AckMode.CLIENT)
                consumer = session.create_consumer(self.queue)
                connection.start()
                pending: list[int] = []
                while not self.stop.is_set():
                    message = consumer.receive(0.2)
                    if message is not None:
                        seq = int(str(message.properties["seq"]))
                        self.handed.append(seq)
                        pending.append(seq)
                    if len(pending) >= ACK_BATCH or (message is None and pending):
                        self._acknowledge(session, pending)
                        pending = []
                if pending:
                    self._acknowledge(session, pending)
                self.reports = connection.reports
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()

    def _acknowledge(self, session: hafailover.Session, pending: list[int]) -> None:
        try:
            session.acknowledge()
        except StaleAcknowledgeError:
            self.stale += 1
            return
        except (UnblockedError, AcknowledgeFailedError):
            self.in_doubt.extend(pending)
            return
        self.acknowledged.extend(pending)


def _node(cluster: RabbitMQCluster, client: Producer | Consumer) -> int | None:
    connection = client.connection
    return None if connection is None else cluster.node_of(connection.broker)


def _check_running(*clients: Producer | Consumer) -> None:
    for client in clients:
        assert client.error is None, client.error
        assert client.is_alive(), f"{client.name} ended early"


def _kill_and_restart(
    cluster: RabbitMQCluster, victim: int, producer: Producer, consumer: Consumer
) -> None:
    """SIGKILL node ``victim``, wait until no client is on it, start it again, and wait until
    both clients make progress."""
    cluster.kill(victim)
    wait_until(
        lambda: all(_node(cluster, c) not in (None, victim) for c in (producer, consumer)),
        30,
        f"both clients on a node other than the killed node {victim}",
    )
    cluster.start(victim)
    confirmed, acknowledged = len(producer.confirmed), len(consumer.acknowledged)
    wait_until(
        lambda: len(producer.confirmed) > confirmed and len(consumer.acknowledged) > acknowledged,
        30,
        f"progress after node {victim} came back",
    )


def _let_consumer_catch_up(producer: Producer, consumer: Consumer, timeout: float) -> None:
    """Let the consumer run until it has every confirmed send, or ``timeout`` passes (what it
    has not taken by then is drained after it, and counted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and consumer.is_alive() and not producer.is_alive():
        if set(producer.confirmed) <= set(consumer.acknowledged + consumer.in_doubt):
            return
        time.sleep(0.1)


def _duplicates(received: list[int]) -> dict[int, int]:
    return {seq: n for seq, n in collections.Counter(received).items() if n > 1}


@pytest.mark.timeout(360, func_only=True)
def test_nothing_lost_on_a_quorum_queue_when_the_clients_node_is_killed(
    cluster: RabbitMQCluster, protocol: str
) -> None:
    name = f"hafailover-cluster-loss-{protocol}-{uuid.uuid4().hex[:8]}"
    cluster.declare_quorum_queue(name)
    assert cluster.queue_types().get(name) == "quorum"
    queue = f"/amq/queue/{name}"
    url = cluster.failover_url(protocol, OPTIONS)
    producer = Producer(url, queue)
    consumer = Consumer(url, queue)
    started = time.monotonic()
    kills: list[int] = []
    producer.start()
    consumer.start()
    try:
        wait_until(lambda: len(consumer.acknowledged) >= ACK_BATCH, 30, "the first traffic")
        for _cycle in range(CYCLES):
            time.sleep(TRAFFIC_TIME)
            _check_running(producer, consumer)
            # The producer's node, then the consumer's if it is another: one node down at a
            # time, so the quorum queue keeps its majority.
            victims = [_node(cluster, producer), _node(cluster, consumer)]
            for victim in dict.fromkeys(victims):
                assert victim is not None, f"a client is on no node of the cluster: {victims}"
                _kill_and_restart(cluster, victim, producer, consumer)
                kills.append(victim)
        _check_running(producer, consumer)
    finally:
        producer.stop.set()
        producer.join(90)
        _let_consumer_catch_up(producer, consumer, 30)
        consumer.stop.set()
        consumer.join(60)
    assert not producer.is_alive(), "the producer did not stop"
    assert not consumer.is_alive(), "the consumer did not stop"
    assert producer.error is None, producer.error
    assert consumer.error is None, consumer.error

    drained = seqs(drain(url, queue, idle=2.0))
    received = consumer.acknowledged + drained
    confirmed = set(producer.confirmed)
    lost = sorted(confirmed - set(received) - set(consumer.in_doubt))
    unexpected = sorted(set(received + consumer.handed) - producer.attempted)
    duplicates = _duplicates(received)
    elapsed = time.monotonic() - started
    print(
        f"\ncluster loss checker [{protocol}] {CYCLES} cycles, nodes killed {kills}, "
        f"in {elapsed:.1f}s: attempted={len(producer.attempted)} "
        f"confirmed={len(producer.confirmed)} (resent by the client={producer.client_resent}, "
        f"by the application={producer.resends}) handed={len(consumer.handed)} "
        f"acknowledged={len(consumer.acknowledged)} (stale acks={consumer.stale}, "
        f"in doubt={len(consumer.in_doubt)}) drained={len(drained)} lost={len(lost)} "
        f"unexpected={len(unexpected)} duplicates={len(duplicates)} "
        f"(extra copies={sum(n - 1 for n in duplicates.values())}) "
        f"failovers producer={len(producer.reports)} consumer={len(consumer.reports)}"
    )
    # Each cycle killed the node of both clients: each failed over at least once a cycle,
    # always by reconnecting, and said what the broker lacks.
    assert len(kills) >= CYCLES
    for client in (producer, consumer):
        assert len(client.reports) >= CYCLES, (client.name, [r.summary() for r in client.reports])
        for report in client.reports:
            assert report.to_broker is not None, report.summary()
            assert report.reattached is False
            assert "reattach" in report.degraded
            assert "duplicate detection" in report.degraded
    assert len(producer.confirmed) == len(confirmed), "a seq confirmed twice"
    handed = set(consumer.handed)
    assert lost == [], f"lost: {lost[:50]}, of which handed to the consumer once: " + str(
        [seq for seq in lost[:50] if seq in handed]
    )
    assert unexpected == [], f"unexpected: {unexpected[:50]}"
    # What the consumer acknowledged, it acknowledged once: every copy that came again was
    # dropped by its duplicate window (a batch whose acknowledge went stale was never
    # acknowledged, so its redelivery is a delivery).
    assert _duplicates(consumer.acknowledged) == {}, _duplicates(consumer.acknowledged)
    cluster.ctl(1, "delete_queue", name)  # the cluster does not gather queues across runs
