"""Traced hafailover for tests: the SDK's in-memory exporter behind the instrumentor, and
ways to find the spans a test expects. Importing it asks for the SDK first
(``pytest.importorskip``): a machine without the extra skips those tests (CI fails them)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer

from hafailover.otel import HaFailoverInstrumentor


class Spans:
    """What the instrumented process recorded."""

    def __init__(self, exporter: InMemorySpanExporter, provider: TracerProvider) -> None:
        self.exporter = exporter
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("tests")  # the application's own spans

    def all(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())

    def of(self, kind: SpanKind, operation: str | None = None) -> list[ReadableSpan]:
        return [
            span
            for span in self.all()
            if span.kind is kind
            and span.instrumentation_scope is not None
            and span.instrumentation_scope.name == "hafailover.otel"
            and (
                operation is None
                or (span.attributes or {}).get("messaging.operation.type") == operation
            )
        ]

    def failovers(self) -> list[ReadableSpan]:
        return [span for span in self.of(SpanKind.INTERNAL) if span.name == "failover"]

    def wait_for(
        self,
        found: Callable[[], Sequence[ReadableSpan]],
        count: int,
        what: str,
        timeout: float = 30.0,
    ) -> list[ReadableSpan]:
        deadline = time.monotonic() + timeout
        while True:
            spans = list(found())
            if len(spans) >= count:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(spans)} {what} span(s) after {timeout}s, not {count}")
            time.sleep(0.02)


@contextlib.contextmanager
def instrumented() -> Iterator[Spans]:
    """hafailover traced into an in-memory exporter, for the ``with`` block."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = HaFailoverInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield Spans(exporter, provider)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
