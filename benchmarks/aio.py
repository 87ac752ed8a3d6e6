"""hafailover.aio against the threaded API it is built on, in one run.

Run: .venv/bin/python benchmarks/aio.py [--quick] [--json]

hafailover.aio bridges the threaded driver to asyncio (docs/aio.md). That is allowed only
while it costs under 10%: each path below is measured through both APIs against one bundled
pair (live + synchronized backup, persistent 1 KiB messages), alternated, best of
--repeats, and printed as a ratio aio / threaded (higher is better; 0.9 is the floor):

1. confirmed sends one at a time: ``await producer.send()`` vs ``producer.send()``;
2. pipelined confirmed sends: ``send_nowait`` for each, then ``await flush()``, vs
   ``send_async`` for each, then ``flush()``; and the same sends awaited one by one in
   order (each await a suspension of the task: a cost the threaded flush does not pay);
3. receives of N queued messages in AUTO, CLIENT (acknowledge every 100) and DUPS_OK,
   prefetch 100: ``await consumer.receive()`` vs ``consumer.receive()``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from hafailover import AckMode, aio  # noqa: E402
from hafailover.tools.paths import (  # noqa: E402
    BODY,
    PathResult,
    fill,
    queue_name,
    receive,
    send_one_at_a_time,
    send_pipelined,
)
from reference_broker.pair import BrokerPair  # noqa: E402

MODES = (AckMode.AUTO, AckMode.CLIENT, AckMode.DUPS_OK)


def best(repeats: int, runs: dict[str, Callable[[], PathResult]]) -> dict[str, PathResult]:
    """Each contender ``repeats`` times, alternated; the run with the best rate kept."""
    results: dict[str, list[PathResult]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return {name: max(rs, key=lambda r: r.rate) for name, rs in results.items()}


async def aio_send(url: str, count: int) -> PathResult:
    async with await aio.connect(url) as connection:
        producer = (await connection.create_session()).create_producer(f"queue://{queue_name()}")
        latencies = []
        start = time.perf_counter()
        for _ in range(count):
            sent = time.perf_counter()
            await producer.send(BODY)
            latencies.append(time.perf_counter() - sent)
        return PathResult(count, time.perf_counter() - start, tuple(latencies))


async def aio_pipelined(url: str, count: int, *, each: bool) -> PathResult:
    """``send_nowait`` for each message, then ``flush()`` (as ``send_async`` + ``flush``),
    or awaiting each send in turn (``each``)."""
    async with await aio.connect(url) as connection:
        producer = (await connection.create_session()).create_producer(f"queue://{queue_name()}")
        start = time.perf_counter()
        pending = [producer.send_nowait(BODY) for _ in range(count)]
        if each:
            for sent in pending:
                await sent
        else:
            await producer.flush()
        return PathResult(count, time.perf_counter() - start)


async def aio_receive(url: str, queue: str, count: int, mode: AckMode) -> PathResult:
    async with await aio.connect(url) as connection:
        session = await connection.create_session(mode)
        consumer = await session.create_consumer(f"queue://{queue}", prefetch=100)
        connection.start()
        start = time.perf_counter()
        for n in range(1, count + 1):
            message = await consumer.receive(30)
            if message is None:
                raise TimeoutError(f"only {n - 1} of {count} messages arrived within 30 s")
            if mode is AckMode.CLIENT and (n % 100 == 0 or n == count):
                await session.acknowledge(message)
        return PathResult(count, time.perf_counter() - start)


def filled_then(url: str, count: int, run: Callable[[str], PathResult]) -> PathResult:
    queue = queue_name()
    fill(url, queue, count)
    return run(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and one run")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--repeats", type=int, help="alternated runs, best kept (3)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    one = 200 if args.quick else 1000
    many = 2000 if args.quick else 10_000
    received = 1000 if args.quick else 5000
    rows: list[dict[str, Any]] = []

    def row(
        path: str, got: dict[str, PathResult], latency: bool = False, *, same: bool = True
    ) -> None:
        """``same``: both APIs do the same thing (the 0.9 floor applies); else shown only."""
        ours, threaded = got["aio"], got["threaded"]
        entry: dict[str, Any] = {
            "path": path,
            "same_work": same,
            "aio_rate": round(ours.rate, 1),
            "threaded_rate": round(threaded.rate, 1),
            "ratio": round(ours.rate / threaded.rate, 2),
        }
        if latency:
            entry.update(
                aio_p50_ms=round(ours.p(50), 2),
                aio_p99_ms=round(ours.p(99), 2),
                threaded_p50_ms=round(threaded.p(50), 2),
                threaded_p99_ms=round(threaded.p(99), 2),
            )
        rows.append(entry)

    with (
        tempfile.TemporaryDirectory() as tmp,
        BrokerPair(Path(tmp) / "pair", heartbeat_timeout=60, log_level="WARNING") as pair,
    ):
        pair.wait_synchronized(60)
        for protocol, url in (("stomp", pair.stomp_url), ("amqp", pair.amqp_url)):
            row(
                f"{protocol} send(), one at a time",
                best(
                    repeats,
                    {
                        "aio": lambda u=url: asyncio.run(aio_send(u, one)),
                        "threaded": lambda u=url: send_one_at_a_time(
                            u, one, wait_on_completion=False
                        ),
                    },
                ),
                latency=True,
            )
            count = many if protocol == "stomp" else many // 2
            for each in (False, True):
                row(
                    f"{protocol} pipelined confirmed{', each awaited' if each else ''}",
                    best(
                        repeats,
                        {
                            "aio": lambda u=url, n=count, e=each: asyncio.run(
                                aio_pipelined(u, n, each=e)
                            ),
                            "threaded": lambda u=url, n=count: send_pipelined(u, n),
                        },
                    ),
                    same=not each,
                )
            for mode in MODES:
                n = received if mode is not AckMode.AUTO else max(100, received // 4)
                row(
                    f"{protocol} receive {mode.value}, prefetch 100",
                    best(
                        repeats,
                        {
                            "aio": lambda u=url, n=n, m=mode: filled_then(
                                u, n, lambda q: asyncio.run(aio_receive(u, q, n, m))
                            ),
                            "threaded": lambda u=url, n=n, m=mode: filled_then(
                                u, n, lambda q: receive(u, q, n, m, 100)
                            ),
                        },
                    ),
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'path':<40} {'aio':>10} {'threaded':>10} {'ratio':>6}  p50/p99 ms (aio | threaded)")
    for entry in rows:
        line = (
            f"{entry['path']:<40} {entry['aio_rate']:>10,.0f} {entry['threaded_rate']:>10,.0f}"
            f" {entry['ratio']:>6.2f}"
        )
        if "aio_p50_ms" in entry:
            line += (
                f"  {entry['aio_p50_ms']:.2f}/{entry['aio_p99_ms']:.2f}"
                f" | {entry['threaded_p50_ms']:.2f}/{entry['threaded_p99_ms']:.2f}"
            )
        print(line)
    worst = min(entry["ratio"] for entry in rows if entry["same_work"])
    print(
        f"lowest ratio {worst:.2f} where both do the same work (the bridge is allowed while"
        " each is >= 0.90; 'each awaited' is shown, not held to it)"
    )


if __name__ == "__main__":
    main()
