"""OpenTelemetry spans against the bundled pair, over STOMP and AMQP, through a SIGKILL of
the live: each message's trace goes from the producer's send span across the broker to the
consumer's span, and each failover makes one span with its report's figures."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra and opentelemetry-sdk")

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
)

import hafailover
import hafailover.otel
from hafailover import AckMode, ErrorCode, FailoverReport, Message, UnblockedError
from reference_broker import BrokerPair
from tests.otel.spans import Spans, instrumented

from .support import STEADY_HEARTBEAT, url_for, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def spans() -> Iterator[Spans]:
    with instrumented() as recorded:
        yield recorded


def port_of(pair: BrokerPair, protocol: str, *, live: bool) -> int:
    node = pair.live if live else pair.backup
    return node.stomp_port if protocol == "stomp" else node.amqp_port


def attributes(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def figures(report: FailoverReport) -> dict[str, object]:
    """What a failover span must say about ``report``."""
    outcome = "reattached" if report.reattached else "reconnected"
    return {
        "hafailover.failover.outcome": (
            outcome if report.code is ErrorCode.FAILOVER else "disconnected"
        ),
        "hafailover.failover.code": report.code.value,
        "hafailover.failover.from_broker": report.from_broker,
        "hafailover.failover.attempts": report.attempts,
        "hafailover.failover.duration": report.duration,
        "hafailover.failover.replayed": report.replayed,
        "hafailover.failover.resent": len(report.resent),
        "hafailover.failover.in_doubt": len(report.in_doubt),
        "hafailover.failover.stale_acks": len(report.stale_acks),
        "hafailover.failover.transactions_rolled_back": len(report.transactions_rolled_back),
    }


def span_of(spans: list[ReadableSpan], report: FailoverReport) -> ReadableSpan:
    wanted = figures(report)
    matching = [s for s in spans if {k: attributes(s).get(k) for k in wanted} == wanted]
    assert len(matching) == 1, f"{len(matching)} failover spans say {wanted}"
    return matching[0]


# The connections count their failovers exactly (one each, the kill's): with the suite's 250 ms
# heart-beat a live broker that stalled for half a second on a loaded machine once made both
# fail over early as well. The kill itself is noticed by the socket's reset.


def test_each_message_is_traced_from_its_send_to_its_listener_through_a_sigkill(
    pair: BrokerPair, protocol: str, spans: Spans
) -> None:
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat=STEADY_HEARTBEAT)
    live_port = port_of(pair, protocol, live=True)
    backup_port = port_of(pair, protocol, live=False)
    processed: dict[int, tuple[Message, SpanContext]] = {}
    lock = threading.Lock()

    def listener(message: Message) -> None:
        with lock:  # a message delivered again keeps its first processing
            processed.setdefault(
                int(str(message.properties["seq"])),
                (message, trace.get_current_span().get_span_context()),
            )

    with hafailover.connect(url) as consuming, hafailover.connect(url) as producing:
        consumer = consuming.create_session(AckMode.AUTO).create_consumer("queue://traced")
        consumer.set_message_listener(listener)
        consuming.start()
        producer = producing.create_session(AckMode.AUTO).create_producer("queue://traced")
        sent: list[Message] = []

        def send(n: int) -> None:
            message = Message(body=f"m{n}", properties={"seq": n}, correlation_id=f"conv-{n}")
            sent.append(producer.send(message))

        with spans.tracer.start_as_current_span("before") as before:
            for n in range(10):
                send(n)
        killed_at = time.time_ns()
        pair.kill(pair.live)
        with spans.tracer.start_as_current_span("after") as after:
            for n in range(10, 20):
                send(n)  # the first waits for the failover (F1)
        wait_until(lambda: len(processed) == 20, 60, "every message processed")
        wait_until(
            lambda: len(producing.reports) == 1 and len(consuming.reports) == 1,
            30,
            "both connections' failovers",
        )
        reports = [producing.reports[0], consuming.reports[0]]
    failed_over_by = time.time_ns()

    sends = {attributes(s)["messaging.message.id"]: s for s in spans.of(SpanKind.PRODUCER)}
    assert len(sends) == 20
    processes = {s.context.span_id: s for s in spans.of(SpanKind.CONSUMER, "process")}
    for n, message in enumerate(sent):
        send_span = sends[message.message_id]
        assert send_span.name == "send traced"
        assert send_span.status.status_code is StatusCode.UNSET
        assert parent_id(send_span) == (before if n < 10 else after).get_span_context().span_id
        assert {
            key: attributes(send_span)[key]
            for key in (
                "messaging.system",
                "messaging.operation.type",
                "messaging.destination.name",
                "messaging.message.conversation_id",
                "server.port",
            )
        } == {
            "messaging.system": protocol,
            "messaging.operation.type": "send",
            "messaging.destination.name": "traced",
            "messaging.message.conversation_id": f"conv-{n}",
            # Sent before the SIGKILL to the live; after it, to the backup.
            "server.port": live_port if n < 10 else backup_port,
        }
        # Across the broker: the listener's span is a child of the producer's send span.
        received, inside = processed[n]
        process = processes[inside.span_id]
        assert process.name == "process traced"
        assert process.context.trace_id == send_span.context.trace_id
        assert parent_id(process) == send_span.context.span_id
        assert [link.context.span_id for link in process.links] == [send_span.context.span_id]
        assert attributes(process)["messaging.message.id"] == received.message_id
        assert attributes(process)["messaging.system"] == protocol
        assert str(received.properties["traceparent"]).split("-")[2] == (
            f"{send_span.context.span_id:016x}"
        )

    failovers = spans.wait_for(spans.failovers, 2, "failover")
    assert len(failovers) == 2  # one per connection
    for report in reports:
        span = span_of(failovers, report)
        assert span.parent is None
        assert attributes(span)["server.port"] == backup_port  # where it went
        assert span.start_time is not None and span.end_time is not None
        assert killed_at <= span.start_time < span.end_time <= failed_over_by
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(report.duration)


def test_receive_spans_and_the_failover_figures_of_dirty_sessions_and_doubtful_sends(
    pair: BrokerPair, protocol: str, spans: Spans
) -> None:
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat=STEADY_HEARTBEAT)
    with (
        hafailover.connect(url) as connection,
        hafailover.connect(
            url_for(pair, protocol, duplicate_detection="false", heartbeat=STEADY_HEARTBEAT)
        ) as doubtful,
        hafailover.connect(
            url_for(pair, protocol, reconnect_attempts=0, heartbeat=STEADY_HEARTBEAT)
        ) as doomed,
    ):
        producer = connection.create_session(AckMode.AUTO).create_producer("queue://pulled")
        # A caller's context with a trace state (a ':' to escape in a STOMP header) and
        # baggage: both travel with the message.
        caller = SpanContext(
            trace_id=0x5CE0E9A56015FEC5AADFA328AE398115,
            span_id=0xB7AD6B7169203331,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=TraceState([("vendor", "a:b")]),
        )
        context = baggage.set_baggage(
            "tenant", "t 1", trace.set_span_in_context(NonRecordingSpan(caller))
        )
        token = otel_context.attach(context)
        try:
            with spans.tracer.start_as_current_span("app"):
                sent = producer.send(Message(body="pulled", properties={"seq": 1}))
        finally:
            otel_context.detach(token)
        client = connection.create_session(AckMode.CLIENT)
        consumer = client.create_consumer("queue://pulled", prefetch=1)
        connection.start()
        with spans.tracer.start_as_current_span("worker") as worker:
            held = consumer.receive(10)
            assert held is not None
            with hafailover.otel.process(consumer, held):
                inside = trace.get_current_span().get_span_context()
                tenant = baggage.get_baggage("tenant")
        # ``held`` is never acknowledged: the CLIENT session is dirty at the failover (F8);
        # the transaction has work: it becomes rollback-only (F9).
        transacted = connection.create_session(AckMode.SESSION_TRANSACTED)
        transacted.create_producer("queue://traced-tx").send("uncommitted")
        # Sends the live never confirms (it is paused, then killed): without duplicate ids
        # they are released in doubt, unless a reattach replays them (F3, F4).
        doubtful_producer = doubtful.create_session().create_producer("queue://doubt")
        live = pair.live
        pair.pause(live)
        pending = [doubtful_producer.send_async(f"d{n}") for n in range(3)]
        pair.kill(live)
        for completion in pending:
            with contextlib.suppress(UnblockedError):
                completion.result(30)
        wait_until(
            lambda: all(len(c.reports) == 1 for c in (connection, doubtful, doomed)),
            30,
            "three failover reports",
        )
        report, doubtful_report, doomed_report = (
            c.reports[0] for c in (connection, doubtful, doomed)
        )

    # Pulled: the receive span is the caller's child and links to the send span; the
    # processing of what it returned is a child of the send span.
    (send_span,) = [
        s
        for s in spans.of(SpanKind.PRODUCER)
        if attributes(s)["messaging.message.id"] == sent.message_id
    ]
    (receive,) = spans.of(SpanKind.CLIENT, "receive")
    assert receive.name == "receive pulled"
    assert parent_id(receive) == worker.get_span_context().span_id
    assert [link.context.span_id for link in receive.links] == [send_span.context.span_id]
    assert attributes(receive)["messaging.message.id"] == held.message_id
    assert attributes(receive)["messaging.system"] == protocol
    (process,) = [s for s in spans.of(SpanKind.CONSUMER) if s.context == inside]
    assert process.context.trace_id == caller.trace_id
    assert process.context.trace_state.get("vendor") == "a:b"
    assert tenant == "t 1"
    assert parent_id(process) == send_span.context.span_id
    assert [link.context.span_id for link in process.links] == [
        send_span.context.span_id,
        worker.get_span_context().span_id,
    ]

    failovers = spans.wait_for(spans.failovers, 3, "failover")
    assert len(failovers) == 3
    dirty = span_of(failovers, report)
    assert report.stale_acks and report.transactions_rolled_back == (transacted.session_id,)
    assert attributes(dirty)["hafailover.failover.stale_ack_ids"] == report.stale_acks
    assert attributes(dirty)["hafailover.failover.rolled_back_sessions"] == (transacted.session_id,)
    uncertain = span_of(failovers, doubtful_report)
    assert doubtful_report.replayed + len(doubtful_report.in_doubt) >= 3
    if doubtful_report.in_doubt:
        assert attributes(uncertain)["hafailover.failover.in_doubt_ids"] == (
            doubtful_report.in_doubt
        )
    # A send's span ends on the thread that completed it, just after result() returned.
    doubtful_spans = spans.wait_for(
        lambda: [
            s
            for s in spans.of(SpanKind.PRODUCER)
            if attributes(s)["messaging.destination.name"] == "doubt"
        ],
        len(pending),
        "the doubtful sends' spans",
    )
    doubtful_sends = {attributes(s)["messaging.message.id"]: s for s in doubtful_spans}
    for completion in pending:
        assert completion.message is not None
        span = doubtful_sends[completion.message.message_id]
        if isinstance(completion.exception(), UnblockedError):
            assert completion.message.message_id in doubtful_report.in_doubt
            assert span.status.status_code is StatusCode.ERROR
            assert attributes(span)["error.type"] == "hafailover.errors.UnblockedError"
        else:
            assert span.status.status_code is StatusCode.UNSET
    gave_up = span_of(failovers, doomed_report)
    assert attributes(gave_up)["hafailover.failover.outcome"] == "disconnected"
    assert gave_up.status.status_code is StatusCode.ERROR
    assert attributes(gave_up)["error.type"] == "hafailover.errors.DisconnectedError"
