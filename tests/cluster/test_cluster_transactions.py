"""Transactions on a RabbitMQ 3.10 cluster with a quorum queue: what RabbitMQ does not guarantee.

- AMQP 1.0: the plugin has no transactions; it refuses the coordinator (amqp:not-implemented),
  on a cluster as on one node.
- STOMP: RabbitMQ answers a COMMIT once its node has taken the transaction's messages, without
  waiting for the queue to hold them (the plugin replays the transaction's SENDs on its channel
  and sends the receipt at once; no publisher confirm is involved). Until the queue takes them,
  the committed messages live in the memory of the node the client is connected to, and die with
  it. A confirmed send (a SEND with a receipt) is answered only once a majority of the quorum
  queue's replicas hold the message, so its loss is never silent: the client knows it is in
  doubt and resends it. The loss checker (test_cluster_loss_checker.py) therefore uses
  confirmed sends; with a transacted STOMP producer it saw committed messages lost.
"""

from __future__ import annotations

import time
import uuid

import pytest

import hafailover
from hafailover import AckMode, HaFailoverError, Message, ProtocolError
from tests.integration.support import drain, seqs

from .conftest import NODES, RabbitMQCluster

pytestmark = [pytest.mark.cluster]

OPTIONS = "reconnect_attempts=-1&heartbeat=1s&retry_interval=100ms&max_retry_interval=1s"


@pytest.mark.timeout(60, func_only=True)
def test_amqp_transactions_are_refused_clearly_by_the_cluster(cluster: RabbitMQCluster) -> None:
    # The application gets the refusal, not a hang, and its other sessions go on working.
    name = f"hafailover-cluster-tx-{uuid.uuid4().hex[:8]}"
    cluster.declare_quorum_queue(name)
    queue = f"/amq/queue/{name}"
    with hafailover.connect(cluster.failover_url("amqp", OPTIONS)) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        with pytest.raises(ProtocolError, match="amqp:not-implemented"):
            session.create_producer(queue).send(Message(b"never", properties={"seq": 0}))
        other = connection.create_session(AckMode.AUTO)
        other.create_producer(queue).send(Message(b"plain", properties={"seq": 1}))
        consumer = other.create_consumer(queue)
        connection.start()
        message = consumer.receive(timeout=10)
        assert message is not None
        assert message.properties["seq"] in (1, "1")
        assert consumer.receive(timeout=1) is None  # the refused send stored nothing
    cluster.ctl(1, "delete_queue", name)


@pytest.mark.timeout(150, func_only=True)
def test_a_stomp_commit_does_not_wait_for_the_quorum_queue(cluster: RabbitMQCluster) -> None:
    # Deterministic: with two nodes down the queue has no majority and can store nothing. The
    # client is on the third node, a follower of the queue: the leader's node is killed after
    # the other follower's, so no election can move the leader to the client's node.
    name = f"hafailover-cluster-commit-{uuid.uuid4().hex[:8]}"
    cluster.declare_quorum_queue(name)
    queue = f"/amq/queue/{name}"
    leader = cluster.queue_leader(name)
    assert leader in NODES, f"no leader known for {name}"
    client_node, follower = (n for n in NODES if n != leader)
    url = (
        f"stomp://{cluster.user}:{cluster.password}@{cluster.host}:"
        f"{cluster.port('stomp', client_node)}?failover_method=nofailover&reconnect_attempts=0"
        "&heartbeat=1s"
    )
    connection = hafailover.connect(url)
    try:
        transacted = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = transacted.create_producer(queue)
        confirming = connection.create_session(AckMode.AUTO).create_producer(queue)
        confirming.send(Message(b"before", properties={"seq": 0}))  # stored by a majority

        cluster.kill(follower)
        cluster.kill(leader)
        for seq in range(1, 6):
            producer.send(Message(b"committed", properties={"seq": seq}))
        transacted.commit()  # answered: the node has the messages, the queue does not
        unconfirmed = confirming.send_async(Message(b"in doubt", properties={"seq": 6}))
        time.sleep(2)
        assert not unconfirmed.done(), "a confirmed send completed while the queue had no majority"

        cluster.kill(client_node)
        # the client learns that the confirmed send may not be stored: it is never silent
        deadline = time.monotonic() + 15
        while not unconfirmed.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(unconfirmed.exception(), HaFailoverError), unconfirmed.exception()
    finally:
        connection.close()
        # the node that stopped last first: RabbitMQ makes the others wait for it
        for node in (client_node, leader, follower):
            cluster.start(node)

    stored = seqs(drain(cluster.failover_url("stomp", OPTIONS), queue, idle=2.0))
    print(f"\nstomp commit without a majority: the queue holds seqs {sorted(stored)}")
    assert 0 in stored  # confirmed before the kills
    # The commit was answered, and its messages died with the client's node.
    assert not {1, 2, 3, 4, 5} & set(stored), stored
    cluster.ctl(1, "delete_queue", name)
