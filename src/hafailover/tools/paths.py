"""``hafailover perf paths``: what applications do, measured through the library.

One broker URL; each path in turn on its own queue: ``send()`` and
``send_async().result()`` one at a time, pipelined ``send_async`` + ``flush``,
``create_consumer()`` one at a time, commits of
1, 10 and 100 sends, and receives in AUTO, CLIENT (acknowledge every 100) and DUPS_OK with
prefetch 100 and 1000. Rates in messages per second, latencies p50/p99 in milliseconds.
benchmarks/paths.py runs the same functions beside the raw clients.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from hafailover.ack_modes import AckMode
from hafailover.driver import connect
from hafailover.tools._common import percentile
from hafailover.url import FailoverPolicy

__all__ = [
    "PathResult",
    "fill",
    "receive",
    "run_paths",
    "send_one_at_a_time",
    "send_pipelined",
    "subscribe_one_at_a_time",
    "transactions",
]

BODY = b"x" * 1024
_RECEIVE_MODES = (AckMode.AUTO, AckMode.CLIENT, AckMode.DUPS_OK)


@attrs.frozen
class PathResult:
    """Messages per second and per-operation latencies (seconds) of one run."""

    count: int
    elapsed: float
    latencies: tuple[float, ...] = ()

    @property
    def rate(self) -> float:
        return self.count / self.elapsed if self.elapsed > 0 else 0.0

    def p(self, q: float) -> float:
        """The q-th percentile latency in milliseconds (0 without latencies)."""
        return percentile(sorted(self.latencies), q / 100) * 1000 if self.latencies else 0.0


def queue_name(prefix: str = "paths") -> str:
    return f"{prefix}-{time.monotonic_ns()}"


def send_one_at_a_time(
    url: str | FailoverPolicy, count: int, *, wait_on_completion: bool
) -> PathResult:
    """``send()`` (or ``send_async().result()``) one message at a time."""
    with connect(url) as connection:
        producer = connection.create_session().create_producer(f"queue://{queue_name()}")
        latencies = []
        start = time.perf_counter()
        for _ in range(count):
            sent = time.perf_counter()
            if wait_on_completion:
                producer.send_async(BODY).result()
            else:
                producer.send(BODY)
            latencies.append(time.perf_counter() - sent)
        return PathResult(count, time.perf_counter() - start, tuple(latencies))


def subscribe_one_at_a_time(url: str | FailoverPolicy, count: int) -> PathResult:
    """``create_consumer()`` then ``close()``, one at a time on fresh queues; the latencies
    are the creations', each of which waits for the broker's answer to its subscription."""
    with connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT)
        latencies = []
        start = time.perf_counter()
        for _ in range(count):
            began = time.perf_counter()
            consumer = session.create_consumer(f"queue://{queue_name()}")
            latencies.append(time.perf_counter() - began)
            consumer.close()
        return PathResult(count, time.perf_counter() - start, tuple(latencies))


def send_pipelined(url: str | FailoverPolicy, count: int) -> PathResult:
    """``send_async`` every message, then ``flush``."""
    with connect(url) as connection:
        producer = connection.create_session().create_producer(f"queue://{queue_name()}")
        start = time.perf_counter()
        for _ in range(count):
            producer.send_async(BODY)
        producer.flush()
        return PathResult(count, time.perf_counter() - start)


def transactions(url: str | FailoverPolicy, batches: int, size: int) -> PathResult:
    """Transactions of ``size`` sends; latencies are the commits'."""
    with connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer(f"queue://{queue_name()}")
        latencies = []
        start = time.perf_counter()
        for _ in range(batches):
            for _ in range(size):
                producer.send(BODY)
            committed = time.perf_counter()
            session.commit()
            latencies.append(time.perf_counter() - committed)
        return PathResult(batches * size, time.perf_counter() - start, tuple(latencies))


def fill(url: str | FailoverPolicy, queue: str, count: int) -> None:
    """Put ``count`` persistent messages on ``queue``."""
    with connect(url) as connection:
        producer = connection.create_session().create_producer(f"queue://{queue}")
        for _ in range(count):
            producer.send_async(BODY)
        producer.flush()


def receive(
    url: str | FailoverPolicy, queue: str, count: int, mode: AckMode, prefetch: int
) -> PathResult:
    """Receive ``count`` messages from ``queue`` (CLIENT acknowledges every 100)."""
    with connect(url) as connection:
        session = connection.create_session(mode)
        consumer = session.create_consumer(f"queue://{queue}", prefetch=prefetch)
        connection.start()
        start = time.perf_counter()
        for n in range(1, count + 1):
            message = consumer.receive(30)
            if message is None:
                raise TimeoutError(f"only {n - 1} of {count} messages arrived within 30 s")
            if mode is AckMode.CLIENT and (n % 100 == 0 or n == count):
                message.acknowledge()
        return PathResult(count, time.perf_counter() - start)


def subscriptions_per_run(quick: bool) -> int:
    """Consumers created one at a time in a run: at 20, a run's rate moved by a third
    between runs of one tree."""
    return 100 if quick else 500


def run_paths(url: str | FailoverPolicy, *, quick: bool = False) -> list[dict[str, Any]]:
    """Every path once against ``url``: one row each."""
    one = 100 if quick else 1000
    many = 1000 if quick else 10_000
    received = 500 if quick else 5000
    rows: list[dict[str, Any]] = []

    def row(path: str, result: PathResult, *, latency: bool = False) -> None:
        entry: dict[str, Any] = {"path": path, "rate": round(result.rate, 1)}
        if latency:
            entry.update(p50_ms=round(result.p(50), 2), p99_ms=round(result.p(99), 2))
        rows.append(entry)

    row(
        "send(), one at a time",
        send_one_at_a_time(url, one, wait_on_completion=False),
        latency=True,
    )
    row(
        "send_async().result(), one at a time",
        send_one_at_a_time(url, one, wait_on_completion=True),
        latency=True,
    )
    row("send_async + flush, pipelined", send_pipelined(url, many))
    row(
        "create_consumer(), one at a time",
        subscribe_one_at_a_time(url, subscriptions_per_run(quick)),
        latency=True,
    )
    for size in (1, 10, 100):
        row(f"commit of {size}", transactions(url, max(5, one // 2 // size), size), latency=True)
    for prefetch in (100, 1000):
        for mode in _RECEIVE_MODES:
            queue = queue_name()
            fill(url, queue, received)
            row(
                f"receive {mode.value}, prefetch {prefetch}",
                receive(url, queue, received, mode, prefetch),
            )
    return rows
