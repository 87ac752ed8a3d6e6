"""A real Celery worker under failover: the live SIGKILLed twice while the worker runs
late-acknowledged tasks that a producer process sent, on both protocols, with the threads
and the prefork pool. The bundled pair drops duplicate sends by their id and the transport's
delivery window (consumer_dedup) is on: every task runs, none twice. Remote control
(``celery inspect ping``) answers through the backup afterwards."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from tests.integration.support import wait_until

from .conftest import kombu_url

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
CELERY = [sys.executable, "-m", "celery", "-A", "tests.celery.celery_app"]
TASKS = 80
# A new process after a failover must find the backup: the first broker of the URL may be
# the dead one (F12).
OPTIONS = {"consumer_dedup": 1000, "initial_connect_attempts": 4}


def runs_of(path: Path) -> collections.Counter[int]:
    if not path.exists():
        return collections.Counter()
    return collections.Counter(int(line.split()[0]) for line in path.read_text().splitlines())


@contextlib.contextmanager
def worker(env: dict[str, str], pool: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*CELERY, "worker", "-P", pool, "-c", "2", "--without-mingle", "--without-gossip"],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the pool's children go with it
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def celery_env(broker_url: str, queue: str, runs: Path, **extra: str) -> dict[str, str]:
    """The environment of the worker, producer and ``celery inspect`` processes."""
    return {
        **os.environ,
        "HAFAILOVER_CELERY_BROKER": broker_url,
        "HAFAILOVER_CELERY_QUEUE": queue,
        "HAFAILOVER_CELERY_RUNS": str(runs),
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def send_tasks(env: dict[str, str], count: int) -> None:
    """A producer process sends ``count`` tasks (numbered from 0) and exits."""
    subprocess.run(
        [sys.executable, "-m", "tests.celery.celery_app", str(count)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )


def ping(env: dict[str, str]) -> None:
    """``celery inspect ping`` gets the worker's pong: a broadcast out, a reply back."""
    done = subprocess.run(
        [*CELERY, "inspect", "ping", "--timeout", "5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "pong" in done.stdout, done.stdout + done.stderr


def run_through(
    env: dict[str, str],
    pool: str,
    log: Path,
    tasks: int,
    disrupt: Callable[[], None],
    *,
    then: Callable[[], None] | None = None,
) -> collections.Counter[int]:
    """Run a worker on the ``tasks`` tasks sent already; ``disrupt`` the broker once a
    tenth of them ran (and asserts that some are left for it to catch); wait until every
    task ran, then ``then`` (with the worker still up). Returns the runs per task."""
    runs = Path(env["HAFAILOVER_CELERY_RUNS"])
    with worker(env, pool, log):
        wait_until(lambda: sum(runs_of(runs).values()) >= tasks // 10, 30, "the first runs")
        disrupt()
        wait_until(lambda: len(runs_of(runs)) >= tasks, 60, f"all {tasks} tasks run")
        time.sleep(1.0)  # a second run, if any, has time to show
        counted = runs_of(runs)
        if then is not None:
            then()
    return counted


def kill_live(pair: BrokerPair) -> None:
    """SIGKILL the live; start it again as the backup of the node that took over."""
    killed = pair.live
    pair.kill(killed)
    pair.wait_active(10)
    pair.restart(killed)
    pair.wait_synchronized(20)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_every_task_runs_once_through_two_kills(
    pair: BrokerPair, protocol: str, pool: str, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    env = celery_env(
        kombu_url(pair, protocol, **OPTIONS),
        f"tasks-{protocol}-{pool}",
        runs,
        HAFAILOVER_CELERY_TASK_SECONDS="0.15",
    )
    send_tasks(env, TASKS)
    log = tmp_path / "worker.log"

    def two_kills() -> None:
        # Two kills in a row: the second as soon as the pair is whole again.
        for _ in range(2):
            started = sum(runs_of(runs).values())
            assert started < TASKS, "the worker finished before the kill"
            began = time.monotonic()
            kill_live(pair)
            print(
                f"kill after {started} runs; the pair was whole again in "
                f"{time.monotonic() - began:.1f}s"
            )

    # Remote control through the backup: broadcast (fanout) and reply (direct).
    counted = run_through(
        env, pool, log, TASKS, two_kills, then=(lambda: ping(env)) if pool == "threads" else None
    )
    twice = sorted(n for n, c in counted.items() if c > 1)
    print(f"{protocol}/{pool}: sent {TASKS}, run {len(counted)}, run twice {len(twice)}")
    assert sorted(counted) == list(range(TASKS))
    assert twice == [], f"run more than once: {twice}\n{log.read_text()[-3000:]}"
    assert "failover reconnected" in log.read_text()
