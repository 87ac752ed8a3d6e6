"""A Celery worker on the three-node RabbitMQ cluster with a quorum task queue: the node the
worker is on is SIGKILLed while it runs late-acknowledged tasks a producer process sent.

The queue is declared a quorum queue beforehand, and the application says so with Celery's
``task_default_queue_type = "quorum"``: the transport then uses the queue as it exists
(``/amq/queue/NAME``, docs/celery.md). The URL lists the three nodes, node 1 first, so the
worker and the producer start on node 1, which is killed. The queue keeps its majority on
nodes 2 and 3; RabbitMQ detects no duplicates, and the transport's delivery window drops the
copies the kill brings back of what ran or was running. The killed node is left down: the
``cluster`` fixture of the next test starts it again."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.celery.test_worker_failover import celery_env, run_through, runs_of, send_tasks

from .conftest import RabbitMQCluster

pytestmark = [pytest.mark.cluster]

TASKS = 60
OPTIONS = (
    "reconnect_attempts=-1&heartbeat=1s&retry_interval=100ms&max_retry_interval=1s"
    "&consumer_dedup=1000&initial_connect_attempts=4"
)


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.timeout(150, func_only=True)
def test_every_task_runs_once_when_the_workers_node_is_killed(
    cluster: RabbitMQCluster, protocol: str, tmp_path: Path
) -> None:
    name = f"hafailover-celery-{protocol}-{uuid.uuid4().hex[:8]}"
    cluster.declare_quorum_queue(name)
    runs = tmp_path / "runs"
    env = celery_env(
        "hafailover+" + cluster.failover_url(protocol, OPTIONS),
        name,
        runs,
        HAFAILOVER_CELERY_TASK_SECONDS="0.15",
        HAFAILOVER_CELERY_QUEUE_TYPE="quorum",
    )
    try:
        _run(cluster, env, tmp_path / "worker.log", runs, protocol)
    finally:
        cluster.ctl(2, "delete_queue", name)  # the cluster keeps queues across runs


def _run(
    cluster: RabbitMQCluster, env: dict[str, str], log: Path, runs: Path, protocol: str
) -> None:
    send_tasks(env, TASKS)
    assert cluster.queue_types().get(env["HAFAILOVER_CELERY_QUEUE"]) == "quorum"

    def kill_node_1() -> None:
        started = sum(runs_of(runs).values())
        assert started < TASKS, "the worker finished before the kill"
        began = time.monotonic()
        cluster.kill(1)
        print(f"node 1 killed after {started} runs in {time.monotonic() - began:.1f}s")

    counted = run_through(env, "threads", log, TASKS, kill_node_1)
    twice = sorted(n for n, c in counted.items() if c > 1)
    print(f"cluster {protocol}/threads: sent {TASKS}, run {len(counted)}, twice {len(twice)}")
    assert sorted(counted) == list(range(TASKS))
    assert twice == [], f"run more than once: {twice}\n{log.read_text()[-3000:]}"
    assert "failover reconnected" in log.read_text()
