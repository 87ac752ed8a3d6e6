"""An asyncio application: a producer, a consumer and a ticking task on one event loop.

Run: python examples/asyncio_app.py [FAILOVER_URL] [COUNT]
(no URL: the bundled pair). Kill the live broker while it runs: the sends and receives wait
through the failover while the ticker keeps its 10 ms pace (the loop never waits for a
broker), the event stream says what happened, and every message arrives.
"""

from __future__ import annotations

import asyncio
import sys
import time

from _pair import failover_url

from hafailover import AckMode, FailoverCompleted, FailureDetected, Message, aio


async def tick(gaps: list[float]) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


async def watch(connection: aio.AsyncConnection) -> None:
    async for event in connection.events():
        if isinstance(event, FailureDetected):
            print(f"event: lost {event.broker}: {event.reason}", flush=True)
        elif isinstance(event, FailoverCompleted):
            print(f"event: {event.report.summary()}", flush=True)


async def run(url: str, count: int) -> int:
    gaps: list[float] = []
    ticker = asyncio.create_task(tick(gaps))
    async with await aio.connect(url) as connection:
        watcher = asyncio.create_task(watch(connection))
        session = await connection.create_session(AckMode.CLIENT_INDIVIDUAL)
        consumer = await session.create_consumer("queue://example.aio")
        producer = (await connection.create_session()).create_producer("queue://example.aio")
        connection.start()

        async def produce() -> None:
            for seq in range(count):
                await producer.send(Message(f"m{seq}", properties={"seq": seq}))
                if seq % 100 == 99:
                    print(f"sent {seq + 1} (broker {connection.broker})", flush=True)
                await asyncio.sleep(0.005)

        received: set[int] = set()

        async def consume() -> None:
            while len(received) < count:
                message = await consumer.receive(30)
                if message is None:
                    return
                received.add(int(str(message.properties["seq"])))
                try:
                    await session.acknowledge(message)
                except Exception as exc:  # noqa: BLE001 - F8: a stale acknowledge
                    print(f"acknowledge failed ({exc.__class__.__name__}); recovering")
                    await session.recover()

        await asyncio.gather(produce(), consume())
        watcher.cancel()
    ticker.cancel()
    print(f"received {len(received)} of {count}; the loop's longest wait {max(gaps):.3f} s")
    return 0 if len(received) == count else 1


def main(argv: list[str]) -> int:
    count = int(argv[2]) if len(argv) > 2 else 300
    with failover_url(argv) as url:
        return asyncio.run(run(url, count))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
