"""The transport on RabbitMQ (tests/interop's node), STOMP and AMQP 1.0: kombu's basic
cases and a Celery worker running tasks a producer process sent. No broker is disrupted
here: RabbitMQ failover runs are not written yet (docs/celery.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path

import kombu
import pytest

import hafailover.kombu  # noqa: F401 - registers the "hafailover" alias
from tests.integration.support import wait_until
from tests.interop.conftest import RabbitMQ, rabbitmq  # noqa: F401 - the session fixture

from .test_worker_failover import CELERY, ROOT, runs_of, worker

pytestmark = pytest.mark.interop


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


def test_worker_runs_every_task_once(
    rabbitmq: RabbitMQ,  # noqa: F811
    protocol: str,
    tmp_path: Path,
) -> None:
    tasks = 30
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "HAFAILOVER_CELERY_BROKER": rabbit_url(rabbitmq, protocol, consumer_dedup=1000),
        "HAFAILOVER_CELERY_QUEUE": f"celery-t-{uuid.uuid4().hex[:10]}",
        "HAFAILOVER_CELERY_RUNS": str(runs),
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run(
        [sys.executable, "-m", "tests.celery.celery_app", str(tasks)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )
    with worker(env, "threads", tmp_path / "worker.log"):
        wait_until(lambda: len(runs_of(runs)) >= tasks, 30, f"all {tasks} tasks run")
        if protocol == "amqp":
            # Over RabbitMQ's STOMP the worker's reply is refused (docs/celery.md).
            ping = subprocess.run(
                [*CELERY, "inspect", "ping", "--timeout", "5"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "pong" in ping.stdout, ping.stdout + ping.stderr
        time.sleep(0.5)
    counted = runs_of(runs)
    assert sorted(counted) == list(range(tasks))
    assert max(counted.values()) == 1
