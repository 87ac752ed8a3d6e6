"""What OpenTelemetry tracing costs a sender, as ratios measured in one run.

Run: .venv/bin/python benchmarks/tracing.py [--quick] [--json]

Against a bundled pair (live + synchronized backup, persistent 1 KiB messages), over STOMP
and AMQP, the same sends with hafailover not instrumented and instrumented (the SDK's
TracerProvider with a BatchSpanProcessor, as an application would have it, exporting to the
in-memory exporter so that no network is measured), runs alternated, best of --repeats:

1. Pipelined confirmed sends: ``send_async`` + ``flush`` (each send makes a send span, its
   context injected into the message, ended when the broker confirms).
2. Synchronous confirmed sends: ``producer.send()`` one at a time.
3. Receives of N queued messages with ``receive()`` in AUTO (each makes a receive span).

Figures are messages per second; the ratio is traced / untraced (1.0: free).
Needs the otel extra and opentelemetry-sdk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import hafailover  # noqa: E402
from hafailover import AckMode  # noqa: E402
from hafailover.otel import HaFailoverInstrumentor  # noqa: E402
from reference_broker.pair import BrokerPair  # noqa: E402

BODY = b"x" * 1024


def pipelined(url: str, count: int) -> float:
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://bench.tracing")
        started = time.perf_counter()
        for _ in range(count):
            producer.send_async(BODY)
        producer.flush()
        return count / (time.perf_counter() - started)


def one_at_a_time(url: str, count: int) -> float:
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer("queue://bench.tracing")
        started = time.perf_counter()
        for _ in range(count):
            producer.send(BODY)
        return count / (time.perf_counter() - started)


def receives(url: str, count: int) -> float:
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        producer = session.create_producer("queue://bench.tracing.rx", confirm=False)
        for _ in range(count):
            producer.send_async(BODY)
        producer.flush()
        consumer = session.create_consumer("queue://bench.tracing.rx", prefetch=1000)
        connection.start()
        started = time.perf_counter()
        for _ in range(count):
            if consumer.receive(10) is None:
                raise RuntimeError("a queued message did not come")
        return count / (time.perf_counter() - started)


def compare(
    run: Callable[[str, int], float], url: str, count: int, repeats: int, provider: Any
) -> dict[str, float]:
    instrumentor = HaFailoverInstrumentor()
    best = {"untraced": 0.0, "traced": 0.0}
    for _ in range(repeats):
        for traced in (False, True):
            if traced:
                instrumentor.instrument(tracer_provider=provider)
            try:
                rate = run(url, count)
            finally:
                if traced:
                    instrumentor.uninstrument()
            key = "traced" if traced else "untraced"
            best[key] = max(best[key], rate)
    best["ratio"] = best["traced"] / best["untraced"]
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and runs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    pipelined_count, single_count, received_count, repeats = (
        (1000, 200, 1000, 2) if args.quick else (5000, 1000, 5000, 3)
    )
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    figures: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="hafailover-bench-") as tmp,
        BrokerPair(tmp, user="bench", password="bench") as pair,
    ):
        pair.wait_synchronized(30)
        for protocol, url in (("stomp", pair.stomp_url), ("amqp", pair.amqp_url)):
            for name, run, count in (
                ("pipelined sends", pipelined, pipelined_count),
                ("send() one at a time", one_at_a_time, single_count),
                ("receive()", receives, received_count),
            ):
                figures[f"{protocol} {name}"] = compare(run, url, count, repeats, provider)
    provider.shutdown()
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{'':32} {'untraced':>10} {'traced':>10} {'ratio':>6}  (messages/s)")
    for name, figure in figures.items():
        print(
            f"{name:32} {figure['untraced']:10.0f} {figure['traced']:10.0f} {figure['ratio']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
