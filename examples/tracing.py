"""OpenTelemetry traces through a failover (needs the ``otel`` extra and opentelemetry-sdk).

Run: python examples/tracing.py [FAILOVER_URL] [SECONDS]
(no URL: the bundled pair). A producer sends orders inside an application span, a message
listener processes them on another connection; kill the live broker while it runs. At the
end it prints what the traces say: each processing span is a child of its message's send
span (the context travels in the message), and each connection's failover is one span
with the report's figures. Spans go to an in-memory exporter here; an application would
give the instrumentor its own TracerProvider (with an OTLP exporter, say).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from _pair import failover_url
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import hafailover
from hafailover import AckMode, Message
from hafailover.otel import HaFailoverInstrumentor


def main(argv: list[str]) -> int:
    seconds = float(argv[2]) if len(argv) > 2 else 3.0
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    HaFailoverInstrumentor().instrument(tracer_provider=provider)
    tracer = provider.get_tracer("order-service")
    processed = threading.Semaphore(0)

    def listener(message: Message) -> None:  # runs inside its "process orders" span
        processed.release()

    with (
        failover_url(argv) as url,
        hafailover.connect(url) as consuming,
        hafailover.connect(url) as producing,
    ):
        consumer = consuming.create_session(AckMode.AUTO).create_consumer("queue://orders")
        consumer.set_message_listener(listener)
        consuming.start()
        producer = producing.create_session().create_producer("queue://orders")
        sent = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with tracer.start_as_current_span("place order"):
                producer.send(Message(body=f"order {sent}", properties={"seq": sent}))
            sent += 1
            if sent % 50 == 0:
                print(f"sent {sent} (broker {producing.broker})", flush=True)
            time.sleep(0.005)
        for _ in range(sent):
            if not processed.acquire(timeout=30):
                break
        failovers = producing.statistics().failovers + consuming.statistics().failovers
        while time.monotonic() < deadline + 10 and len(_failover_spans(exporter)) < failovers:
            time.sleep(0.05)  # the failover spans are made on the listener thread
    HaFailoverInstrumentor().uninstrument()

    finished = exporter.get_finished_spans()
    sends = {s.context.span_id: s for s in finished if s.kind is SpanKind.PRODUCER}
    children = Counter(
        "child of its send span"
        if s.parent is not None and s.parent.span_id in sends
        else "without a send span"
        for s in finished
        if s.kind is SpanKind.CONSUMER
    )
    print(f"traces: {len(sends)} sends; processing spans: {dict(children)}")
    for span in _failover_spans(exporter):
        figures = {
            key.removeprefix("hafailover.failover."): value
            for key, value in (span.attributes or {}).items()
            if key.startswith("hafailover.failover.") and not key.endswith(("ids", "reason"))
        }
        print(f"failover span: {figures['outcome']}: {figures}")
    return 0


def _failover_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "failover"]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
