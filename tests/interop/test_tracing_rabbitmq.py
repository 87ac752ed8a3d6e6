"""Tracing against RabbitMQ 3.10, over STOMP and AMQP 1.0: the broker names itself, so the
spans say ``messaging.system`` ``rabbitmq``; the trace context rides through RabbitMQ in the
message (a STOMP header, an AMQP application property) and a listener's span is a child of
the sender's span."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind

import hafailover
from hafailover import AckMode, Message
from tests.interop.conftest import RabbitMQ
from tests.otel.spans import Spans, instrumented

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


@pytest.fixture
def spans() -> Iterator[Spans]:
    with instrumented() as recorded:
        yield recorded


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_spans_name_rabbitmq_and_the_context_crosses_it(
    rabbitmq: RabbitMQ, protocol: str, spans: Spans
) -> None:
    port = rabbitmq.stomp_port if protocol == "stomp" else rabbitmq.amqp_port
    url = f"{protocol}://{rabbitmq.user}:{rabbitmq.password}@{rabbitmq.host}:{port}"
    queue = f"queue://hafailover-tracing-{uuid.uuid4().hex[:10]}"
    processed: list[tuple[Message, SpanContext]] = []
    done = threading.Event()

    def listener(message: Message) -> None:
        processed.append((message, trace.get_current_span().get_span_context()))
        done.set()

    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        consumer = session.create_consumer(queue)
        consumer.set_message_listener(listener)
        connection.start()
        producer = session.create_producer(queue)
        with spans.tracer.start_as_current_span("app"):
            sent = producer.send(Message(body="traced", correlation_id="conv-1"))
        assert done.wait(20), "the message did not come back"
    (send,) = spans.of(SpanKind.PRODUCER)
    attributes = dict(send.attributes or {})
    assert attributes["messaging.system"] == "rabbitmq"
    assert attributes["network.protocol.name"] == protocol
    assert attributes["server.port"] == port
    assert attributes["messaging.message.id"] == sent.message_id
    assert attributes["messaging.message.conversation_id"] == "conv-1"
    received, inside = processed[0]
    assert str(received.properties["traceparent"]).split("-")[1] == (
        f"{send.context.trace_id:032x}"
    )
    (process,) = [s for s in spans.of(SpanKind.CONSUMER) if s.context == inside]
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert dict(process.attributes or {})["messaging.system"] == "rabbitmq"
