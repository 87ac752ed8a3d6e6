"""hafailover.otel without a broker: the attribute mapping, the spans each hook makes, how
the context goes into a message and comes out of it, and the instrumentor's options."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.semconv._incubating.attributes import messaging_attributes as semconv
from opentelemetry.semconv.attributes import error_attributes, network_attributes, server_attributes
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import hafailover.otel as otel
from hafailover import ErrorCode, FailoverReport, Message, SessionFailover
from hafailover.destination import Destination, DestinationKind
from hafailover.driver import tracing
from hafailover.errors import ConfigurationError, UnblockedError
from hafailover.url import Protocol
from tests.otel.spans import Spans, instrumented

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
STOMP_PAIR = tracing.Peer(Protocol.STOMP, "hafailover-reference-broker/0.1", "127.0.0.1", 61613)
ORDERS = Destination.queue("orders")


@pytest.fixture
def spans() -> Iterator[Spans]:
    with instrumented() as recorded:
        yield recorded


def hooks() -> tracing.TracingHooks:
    installed = tracing.installed()
    assert installed is not None
    return installed


# --- without the extra ----------------------------------------------------------------------


def test_importing_hafailover_imports_no_opentelemetry() -> None:
    script = textwrap.dedent(
        """
        import sys
        import hafailover, hafailover.cli, hafailover.driver, hafailover.tools
        print(sorted(m for m in sys.modules if m.startswith(("opentelemetry", "hafailover.otel"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
    assert tracing.installed() is None  # and nothing is traced until instrument()


# --- the names the conventions give ---------------------------------------------------------


def test_the_attribute_names_are_the_semantic_conventions() -> None:
    assert otel.MESSAGING_SYSTEM == semconv.MESSAGING_SYSTEM
    assert otel.MESSAGING_OPERATION_NAME == semconv.MESSAGING_OPERATION_NAME
    assert otel.MESSAGING_OPERATION_TYPE == semconv.MESSAGING_OPERATION_TYPE
    assert otel.MESSAGING_DESTINATION_NAME == semconv.MESSAGING_DESTINATION_NAME
    assert otel.MESSAGING_DESTINATION_TEMPORARY == semconv.MESSAGING_DESTINATION_TEMPORARY
    assert otel.MESSAGING_MESSAGE_ID == semconv.MESSAGING_MESSAGE_ID
    assert otel.MESSAGING_MESSAGE_CONVERSATION_ID == semconv.MESSAGING_MESSAGE_CONVERSATION_ID
    assert otel.SERVER_ADDRESS == server_attributes.SERVER_ADDRESS
    assert otel.SERVER_PORT == server_attributes.SERVER_PORT
    assert otel.NETWORK_PROTOCOL_NAME == network_attributes.NETWORK_PROTOCOL_NAME
    assert otel.NETWORK_PROTOCOL_VERSION == network_attributes.NETWORK_PROTOCOL_VERSION
    assert otel.ERROR_TYPE == error_attributes.ERROR_TYPE
    operations = semconv.MessagingOperationTypeValues
    conventions = (operations.SEND.value, operations.RECEIVE.value, operations.PROCESS.value)
    assert conventions == (otel.SEND, otel.RECEIVE, otel.PROCESS)


@pytest.mark.parametrize(
    ("protocol", "product", "system"),
    [
        (Protocol.STOMP, "RabbitMQ/3.10.8", semconv.MessagingSystemValues.RABBITMQ.value),
        (Protocol.AMQP, "RabbitMQ", "rabbitmq"),
        (Protocol.STOMP, "ActiveMQ/5.18.3", semconv.MessagingSystemValues.ACTIVEMQ.value),
        (Protocol.AMQP, "apache-activemq-artemis", "activemq"),
        (Protocol.STOMP, "ActiveMQ-Artemis/2.31.2", "activemq"),
        (Protocol.STOMP, "hafailover-reference-broker/0.1", "stomp"),
        (Protocol.AMQP, "hafailover-reference-broker/0.1", "amqp"),
        (Protocol.AMQP, "", "amqp"),
    ],
)
def test_messaging_system_names_the_broker_when_it_says_what_it_is(
    protocol: Protocol, product: str, system: str
) -> None:
    assert otel.messaging_system(tracing.Peer(protocol, product, "h", 1)) == system


def test_a_send_is_named_by_its_destination_and_a_temporary_queue_by_nothing() -> None:
    assert otel.span_name("send", ORDERS) == "send orders"
    assert otel.span_name("process", Destination.topic("prices")) == "process prices"
    assert otel.span_name("receive", Destination(DestinationKind.TEMPORARY_QUEUE, "x1")) == (
        "receive"
    )


def test_the_attributes_of_a_sent_message() -> None:
    message = Message(body="héllo", correlation_id="conv-7", message_id="ID-1")
    assert otel.message_attributes("send", STOMP_PAIR, ORDERS, message) == {
        "messaging.system": "stomp",
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": "orders",
        "hafailover.destination.kind": "queue",
        "messaging.message.id": "ID-1",
        "messaging.message.conversation_id": "conv-7",
        "server.address": "127.0.0.1",
        "server.port": 61613,
        "network.protocol.name": "stomp",
        "network.protocol.version": "1.2",
    }


def test_the_attributes_of_a_received_message_say_whether_it_came_again() -> None:
    peer = tracing.Peer(Protocol.AMQP, "RabbitMQ", "mq", 5672)
    temporary = Destination(DestinationKind.TEMPORARY_QUEUE, "reply-1")
    fresh = otel.message_attributes("receive", peer, temporary, Message(body=b"\x00\x01"))
    assert fresh["messaging.system"] == "rabbitmq"
    assert fresh["network.protocol.version"] == "1.0"
    assert fresh["messaging.destination.temporary"] is True
    assert fresh["hafailover.message.redelivered"] is False
    assert "hafailover.message.delivery_count" not in fresh
    assert "messaging.message.id" not in fresh  # a message without an id has none
    again = Message(body=b"", message_id="m", redelivered=True, delivery_count=2)
    attributes = otel.message_attributes("process", peer, ORDERS, again)
    assert attributes["hafailover.message.redelivered"] is True
    assert attributes["hafailover.message.delivery_count"] == 2
    assert "messaging.destination.temporary" not in attributes


def report(**fields: object) -> FailoverReport:
    values: dict[str, object] = {
        "code": ErrorCode.FAILOVER,
        "reason": "stomp://app@live:61613: connection closed",
        "from_broker": "stomp://app@live:61613",
        "to_broker": "stomp://app@backup:61614",
        "attempts": 3,
        "duration": 1.25,
    }
    values.update(fields)
    return FailoverReport(**values)  # type: ignore[arg-type]


def test_a_failover_span_carries_every_figure_of_the_report() -> None:
    sessions = (
        SessionFailover(1, replayed=(4, 5, 6), resent=("a", "b"), in_doubt=("c",)),
        SessionFailover(2, stale_acks=("t1", "t2"), rolled_back=True, dirty=True),
    )
    attributes = otel.failover_attributes(
        STOMP_PAIR, report(sessions=sessions, degraded=("reattach",))
    )
    assert {k: v for k, v in attributes.items() if k.startswith("hafailover.")} == {
        "hafailover.failover.outcome": "reconnected",
        "hafailover.failover.code": "FAILOVER",
        "hafailover.failover.reattached": False,
        "hafailover.failover.reason": "stomp://app@live:61613: connection closed",
        "hafailover.failover.from_broker": "stomp://app@live:61613",
        "hafailover.failover.to_broker": "stomp://app@backup:61614",
        "hafailover.failover.attempts": 3,
        "hafailover.failover.duration": 1.25,
        "hafailover.failover.replayed": 3,
        "hafailover.failover.resent": 2,
        "hafailover.failover.in_doubt": 1,
        "hafailover.failover.stale_acks": 2,
        "hafailover.failover.transactions_rolled_back": 1,
        "hafailover.failover.resent_ids": ["a", "b"],
        "hafailover.failover.in_doubt_ids": ["c"],
        "hafailover.failover.stale_ack_ids": ["t1", "t2"],
        "hafailover.failover.rolled_back_sessions": [2],
        "hafailover.failover.degraded": ["reattach"],
    }
    assert attributes["server.port"] == 61613
    assert attributes["messaging.system"] == "stomp"


def test_a_failover_span_lists_at_most_max_ids_but_counts_them_all() -> None:
    many = tuple(f"id-{n}" for n in range(otel.MAX_IDS + 10))
    attributes = otel.failover_attributes(
        STOMP_PAIR, report(sessions=(SessionFailover(1, in_doubt=many),))
    )
    assert attributes["hafailover.failover.in_doubt"] == otel.MAX_IDS + 10
    assert attributes["hafailover.failover.in_doubt_ids"] == list(many[: otel.MAX_IDS])


def test_a_failover_that_gave_up_is_disconnected_and_reattach_says_so() -> None:
    given_up = otel.failover_attributes(
        STOMP_PAIR, report(code=ErrorCode.DISCONNECT, to_broker=None)
    )
    assert given_up["hafailover.failover.outcome"] == "disconnected"
    assert "hafailover.failover.to_broker" not in given_up
    reattached = otel.failover_attributes(STOMP_PAIR, report(reattached=True))
    assert reattached["hafailover.failover.outcome"] == "reattached"


# --- the hooks' spans -----------------------------------------------------------------------


def test_a_send_span_is_the_message_creation_context_it_carries(spans: Spans) -> None:
    message = Message(body="x")
    with spans.tracer.start_as_current_span("app") as app:
        hooks().send(STOMP_PAIR, ORDERS, message).end(None, STOMP_PAIR)
    (send,) = spans.of(SpanKind.PRODUCER, "send")
    assert send.name == "send orders"
    assert send.parent is not None and send.parent.span_id == app.get_span_context().span_id
    assert message.message_id is not None  # given by the hook: the span names it
    assert (send.attributes or {})["messaging.message.id"] == message.message_id
    carried = trace.get_current_span(otel.context_of(message)).get_span_context()
    assert (carried.trace_id, carried.span_id) == (send.context.trace_id, send.context.span_id)
    assert set(message.properties) == {"traceparent"}
    assert send.status.status_code is StatusCode.UNSET


def test_a_context_the_application_put_in_the_message_is_kept_and_linked(spans: Spans) -> None:
    with spans.tracer.start_as_current_span("elsewhere") as elsewhere:
        fields: dict[str, str] = {}
        propagate.inject(fields)
    message = Message(body="forwarded", properties=fields)
    hooks().send(STOMP_PAIR, ORDERS, message).end(None, STOMP_PAIR)
    (send,) = spans.of(SpanKind.PRODUCER)
    assert message.properties == fields  # not replaced
    assert [link.context.span_id for link in send.links] == [elsewhere.get_span_context().span_id]


def test_a_send_that_failed_or_went_to_another_broker_says_so(spans: Spans) -> None:
    backup = tracing.Peer(Protocol.STOMP, "hafailover-reference-broker/0.1", "127.0.0.1", 61614)
    hooks().send(STOMP_PAIR, ORDERS, Message(body="x")).end(UnblockedError("lost"), backup)
    (send,) = spans.of(SpanKind.PRODUCER)
    attributes = send.attributes or {}
    assert send.status.status_code is StatusCode.ERROR
    assert attributes["error.type"] == "hafailover.errors.UnblockedError"
    assert attributes["hafailover.error.code"] == "UNBLOCKED"
    assert attributes["server.port"] == 61614
    assert [event.name for event in send.events] == ["exception"]


def test_a_receive_span_starts_with_the_call_and_links_to_the_sender(spans: Spans) -> None:
    sent = Message(body="x")
    hooks().send(STOMP_PAIR, ORDERS, sent).end(None, STOMP_PAIR)
    (send,) = spans.of(SpanKind.PRODUCER)
    started = time.time_ns() - 5_000_000
    with spans.tracer.start_as_current_span("worker") as worker:
        with hooks().receive(STOMP_PAIR, ORDERS, sent, started):
            pass
        with (
            pytest.raises(UnblockedError),
            hooks().receive(STOMP_PAIR, ORDERS, sent, started),
        ):
            raise UnblockedError("the acknowledge was cut")
    received, failed = spans.of(SpanKind.CLIENT, "receive")
    assert received.start_time == started
    assert received.parent is not None
    assert received.parent.span_id == worker.get_span_context().span_id
    assert [link.context.span_id for link in received.links] == [send.context.span_id]
    assert received.status.status_code is StatusCode.UNSET
    assert failed.status.status_code is StatusCode.ERROR


def test_a_process_span_is_a_child_of_the_sender_with_its_baggage(spans: Spans) -> None:
    sent = Message(body="x")
    token = otel_context.attach(baggage.set_baggage("tenant", "t-9"))
    try:
        hooks().send(STOMP_PAIR, ORDERS, sent).end(None, STOMP_PAIR)
    finally:
        otel_context.detach(token)
    (send,) = spans.of(SpanKind.PRODUCER)
    seen: dict[str, object] = {}
    with spans.tracer.start_as_current_span("ambient") as ambient:
        with hooks().process(STOMP_PAIR, ORDERS, sent):
            seen["span"] = trace.get_current_span().get_span_context()
            seen["tenant"] = baggage.get_baggage("tenant")
        assert trace.get_current_span() is ambient  # put back afterwards
    (process,) = spans.of(SpanKind.CONSUMER, "process")
    assert process.name == "process orders"
    assert process.parent is not None
    assert (process.parent.trace_id, process.parent.span_id) == (
        send.context.trace_id,
        send.context.span_id,
    )
    assert [link.context.span_id for link in process.links] == [
        send.context.span_id,
        ambient.get_span_context().span_id,
    ]
    assert seen == {"span": process.context, "tenant": "t-9"}


def test_a_listener_that_raises_marks_its_span_and_a_message_without_context_is_a_child(
    spans: Spans,
) -> None:
    with (
        spans.tracer.start_as_current_span("ambient") as ambient,
        pytest.raises(ValueError, match="bad order"),
        hooks().process(STOMP_PAIR, ORDERS, Message(body="plain")),
    ):
        raise ValueError("bad order")
    (process,) = spans.of(SpanKind.CONSUMER)
    assert process.parent is not None
    assert process.parent.span_id == ambient.get_span_context().span_id
    assert process.links == ()
    assert process.status.status_code is StatusCode.ERROR
    assert (process.attributes or {})["error.type"] == "builtins.ValueError"


def test_a_failover_span_is_a_trace_of_its_own_from_the_loss_to_the_outcome(
    spans: Spans,
) -> None:
    ended = time.time_ns()
    with spans.tracer.start_as_current_span("unrelated"):
        hooks().failover(STOMP_PAIR, report(duration=0.5), ended)
        hooks().failover(STOMP_PAIR, report(code=ErrorCode.DISCONNECT, to_broker=None), ended)
    done, gave_up = spans.failovers()
    assert done.parent is None and gave_up.parent is None
    assert (done.start_time, done.end_time) == (ended - 500_000_000, ended)
    assert done.status.status_code is StatusCode.UNSET
    assert gave_up.status.status_code is StatusCode.ERROR
    assert (gave_up.attributes or {})["error.type"] == "hafailover.errors.DisconnectedError"
    assert (gave_up.attributes or {})["hafailover.error.code"] == "DISCONNECT"


# --- the instrumentor -------------------------------------------------------------------------


def test_instrument_and_uninstrument_install_and_remove_the_hooks() -> None:
    instrumentor = otel.HaFailoverInstrumentor()
    assert instrumentor is otel.HaFailoverInstrumentor()  # one per process, as every one
    instrumentor.instrument(tracer_provider=TracerProvider())
    try:
        assert instrumentor.is_instrumented_by_opentelemetry
        assert tracing.installed() is not None
    finally:
        instrumentor.uninstrument()
    assert tracing.installed() is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"tracer_prvider": TracerProvider()}, "tracer_prvider"),
        ({"tracer_provider": "global"}, "tracer_provider"),
        ({"propagator": object()}, "propagator"),
    ],
)
def test_a_bad_instrument_option_is_refused_by_name(options: dict[str, object], named: str) -> None:
    instrumentor = otel.HaFailoverInstrumentor()
    with pytest.raises(ConfigurationError, match=named):
        instrumentor.instrument(**options)
    assert not instrumentor.is_instrumented_by_opentelemetry
    assert tracing.installed() is None


def test_the_propagator_given_is_the_one_that_carries_the_context() -> None:
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator()]))
    try:
        with instrumented():  # the global one, which carries no trace context now
            plain = Message(body="x")
            hooks().send(STOMP_PAIR, ORDERS, plain).end(None, STOMP_PAIR)
        assert "traceparent" not in plain.properties
        instrumentor = otel.HaFailoverInstrumentor()
        instrumentor.instrument(
            tracer_provider=TracerProvider(), propagator=TraceContextTextMapPropagator()
        )
        try:
            traced = Message(body="x")
            hooks().send(STOMP_PAIR, ORDERS, traced).end(None, STOMP_PAIR)
        finally:
            instrumentor.uninstrument()
        assert "traceparent" in traced.properties
    finally:
        propagate.set_global_textmap(previous)


def test_opentelemetry_instrument_finds_the_instrumentor_by_its_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["opentelemetry_instrumentor"]["hafailover"]
    module, _, name = target.partition(":")
    assert getattr(import_module(module), name) is otel.HaFailoverInstrumentor
    assert "otel" in project["project"]["optional-dependencies"]
