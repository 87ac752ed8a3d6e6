"""The transport on RabbitMQ (tests/interop's node), STOMP and AMQP 1.0: kombu's basic
cases, a transient message to a consumed queue (Celery's remote-control reply), and a
Celery worker running tasks a producer process sent while the node restarts, then
answering ``celery inspect ping``. The three-node cluster's run is in tests/cluster."""

from __future__ import annotations

import contextlib
import time
import uuid
from contextlib import closing
from pathlib import Path

import kombu
import pytest

import hafailover.kombu  # noqa: F401 - registers the "hafailover" alias
from tests.interop.conftest import (  # noqa: F401 - the fixtures
    RabbitMQ,
    RabbitMQControl,
    rabbitmq,
    rabbitmq_control,
)

from .test_worker_failover import celery_env, ping, run_through, runs_of, send_tasks

pytestmark = pytest.mark.interop

TASKS = 60
RECONNECT = {"reconnect_attempts": -1, "retry_interval": "200ms", "max_retry_interval": "1s"}


def rabbit_url(broker: RabbitMQ, protocol: str, **options: object) -> str:
    port = broker.stomp_port if protocol == "stomp" else broker.amqp_port
    query = "&".join(f"{k}={v}" for k, v in {"heartbeat": "1s", **options}.items())
    return f"hafailover+{protocol}://{broker.user}:{broker.password}@{broker.host}:{port}?{query}"


def test_simple_queue_ack_and_requeue(rabbitmq: RabbitMQ, protocol: str) -> None:  # noqa: F811
    name = f"celery-t-{uuid.uuid4().hex[:10]}"
    with (
        kombu.Connection(rabbit_url(rabbitmq, protocol)) as connection,
        closing(connection.SimpleQueue(name)) as queue,
    ):
        queue.put({"n": 1}, headers={"k": "v"}, priority=5)
        queue.put({"n": 2})
        first = queue.get(timeout=5)
        assert first.payload == {"n": 1}
        assert first.headers == {"k": "v"}
        first.requeue()
        second = queue.get(timeout=5)
        second.ack()
        again = queue.get(timeout=5)
        assert sorted([second.payload["n"], again.payload["n"]]) == [1, 2]
        again.ack()
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)


def test_a_transient_message_reaches_a_queue_being_consumed(
    rabbitmq: RabbitMQ,  # noqa: F811
    protocol: str,
) -> None:
    """What Celery's remote-control replies are: delivery_mode 1, to a queue whose consumer
    declared it first. RabbitMQ's STOMP plugin would declare the queue exclusive from a
    SEND's ``persistent:false`` and refuse it (RESOURCE_LOCKED, the connection closed)."""
    name = f"celery-t-{uuid.uuid4().hex[:10]}"
    got: list[kombu.Message] = []
    with (
        kombu.Connection(rabbit_url(rabbitmq, protocol)) as consuming,
        kombu.Connection(rabbit_url(rabbitmq, protocol)) as replying,  # another connection
    ):
        queue = kombu.Queue(name, routing_key=name)
        with consuming.Consumer(queue, callbacks=[lambda _body, m: got.append(m)]):
            time.sleep(0.5)  # the SUBSCRIBE declared the queue (durable) before the send
            with replying.Producer() as producer:
                producer.publish({"reply": 1}, routing_key=name, delivery_mode=1)
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    consuming.drain_events(timeout=0.5)
        assert [m.payload for m in got] == [{"reply": 1}]
        assert got[0].properties["delivery_mode"] == 1  # kombu still sees it transient
        got[0].ack()
        for connection in (consuming, replying):
            assert connection.default_channel.connection.ha.statistics().failovers == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("protocol", "pool"), [("stomp", "threads"), ("amqp", "threads"), ("stomp", "prefork")]
)
def test_every_task_runs_through_a_restart(
    rabbitmq: RabbitMQ,  # noqa: F811
    rabbitmq_control: RabbitMQControl,  # noqa: F811
    protocol: str,
    pool: str,
    tmp_path: Path,
) -> None:
    """A worker (acks_late; threads pool on both protocols, prefork on one) on tasks a
    producer process sent; the node restarts (every connection closed, the durable queue
    and its persistent messages recovered) while it runs them. RabbitMQ detects no
    duplicates: the window drops the copies the restart brings back of what ran or was
    running. Then remote control."""
    env = celery_env(
        rabbit_url(rabbitmq, protocol, **RECONNECT, consumer_dedup=1000),
        f"celery-t-{uuid.uuid4().hex[:10]}",
        tmp_path / "runs",
        HAFAILOVER_CELERY_TASK_SECONDS="0.15",
    )
    send_tasks(env, TASKS)
    log = tmp_path / "worker.log"

    def restart() -> None:
        started = sum(runs_of(tmp_path / "runs").values())
        assert started < TASKS, "the worker finished before the restart"
        away = rabbitmq_control.restart()
        print(f"restart after {started} runs; the node was away {away:.1f}s")

    counted = run_through(env, pool, log, TASKS, restart, then=lambda: ping(env))
    twice = sorted(n for n, c in counted.items() if c > 1)
    print(f"rabbitmq {protocol}/{pool}: sent {TASKS}, run {len(counted)}, twice {len(twice)}")
    assert sorted(counted) == list(range(TASKS))
    assert twice == [], f"run more than once: {twice}\n{log.read_text()[-3000:]}"
    assert "failover reconnected" in log.read_text()
