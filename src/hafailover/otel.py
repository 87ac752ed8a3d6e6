"""OpenTelemetry tracing for hafailover (the ``otel`` extra).

    from hafailover.otel import HaFailoverInstrumentor

    HaFailoverInstrumentor().instrument(tracer_provider=provider)  # None: the global one

(``opentelemetry-instrument`` finds the instrumentor by its entry point and does the same.)
Once instrumented, every connection of the process traces, following the OpenTelemetry
messaging semantic conventions:

- a send: a PRODUCER span ``send {destination}`` from the call until the broker confirmed
  the message (or until it was written, when nothing is confirmed), so a send held up by a
  failover shows it; its context goes with the message as W3C ``traceparent`` /
  ``tracestate`` properties (STOMP headers, AMQP application properties) through the
  propagator, unless the message already carries a creation context, which is kept and
  linked to;
- ``receive()``: a CLIENT span ``receive {destination}`` from the call until it returns the
  message (after its automatic acknowledge), child of the caller's context and linked to
  the message's creation context; a receive that returns nothing makes no span;
- a message listener's call: a CONSUMER span ``process {destination}``, child of the
  message's creation context (the producer's send span) and linked to it, current while
  the listener runs; ``process(consumer, message)`` makes the same span for code that
  processes what ``receive()`` returned;
- a failover: one span ``failover`` from the loss to the outcome, whose attributes are the
  report's figures (``hafailover.failover.*``).

This module imports OpenTelemetry; ``import hafailover`` never imports it (nor this
module). The driver calls it through ``hafailover.driver.tracing``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

# The module is marked to be skipped by type checkers, so its class reads as untyped.
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from hafailover import __version__
from hafailover.core.report import FailoverReport
from hafailover.destination import Destination, DestinationKind
from hafailover.driver import tracing
from hafailover.driver.consumer import Consumer
from hafailover.driver.tracing import Peer
from hafailover.errors import ConfigurationError, DisconnectedError, ErrorCode, HaFailoverError
from hafailover.message import Message, PropertyValue
from hafailover.url import Protocol

__all__ = [
    "HaFailoverInstrumentor",
    "context_of",
    "failover_attributes",
    "message_attributes",
    "messaging_system",
    "process",
    "span_name",
]

# The messaging semantic conventions' attribute names.
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_DESTINATION_NAME: Final = "messaging.destination.name"
MESSAGING_DESTINATION_TEMPORARY: Final = "messaging.destination.temporary"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
MESSAGING_MESSAGE_CONVERSATION_ID: Final = "messaging.message.conversation_id"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
NETWORK_PROTOCOL_NAME: Final = "network.protocol.name"
NETWORK_PROTOCOL_VERSION: Final = "network.protocol.version"
ERROR_TYPE: Final = "error.type"
# hafailover's own, where the conventions have no name.
DESTINATION_KIND: Final = "hafailover.destination.kind"
MESSAGE_REDELIVERED: Final = "hafailover.message.redelivered"
MESSAGE_DELIVERY_COUNT: Final = "hafailover.message.delivery_count"
ERROR_CODE: Final = "hafailover.error.code"
FAILOVER: Final = "hafailover.failover"

# The operation types of the conventions, and the span kind each gets there.
SEND: Final = "send"
RECEIVE: Final = "receive"
PROCESS: Final = "process"
_KINDS: Final = {SEND: SpanKind.PRODUCER, RECEIVE: SpanKind.CLIENT, PROCESS: SpanKind.CONSUMER}

_PROTOCOL_VERSIONS: Final = {Protocol.STOMP: "1.2", Protocol.AMQP: "1.0"}
# The conventions' names for brokers, by what the broker calls itself (lower case).
_SYSTEMS: Final = (("rabbitmq", "rabbitmq"), ("activemq", "activemq"), ("artemis", "activemq"))
# At most this many ids of each kind go on a failover span; the counts are always whole.
MAX_IDS: Final = 256


def messaging_system(peer: Peer) -> str:
    """``messaging.system``: the conventions' name of the broker when it says which it is
    (``rabbitmq``, ``activemq`` for ActiveMQ Classic and Artemis), else the protocol's
    (``stomp``, ``amqp``), as for the bundled pair."""
    product = peer.product.lower()
    for known, system in _SYSTEMS:
        if known in product:
            return system
    return peer.protocol.value


def span_name(operation: str, destination: Destination) -> str:
    """``{operation} {destination}``; a temporary queue's generated name is left out."""
    if destination.kind is DestinationKind.TEMPORARY_QUEUE:
        return operation
    return f"{operation} {destination.name}"


def peer_attributes(peer: Peer) -> dict[str, AttributeValue]:
    return {
        MESSAGING_SYSTEM: messaging_system(peer),
        SERVER_ADDRESS: peer.host,
        SERVER_PORT: peer.port,
        NETWORK_PROTOCOL_NAME: peer.protocol.value,
        NETWORK_PROTOCOL_VERSION: _PROTOCOL_VERSIONS[peer.protocol],
    }


def message_attributes(
    operation: str, peer: Peer, destination: Destination, message: Message
) -> dict[str, AttributeValue]:
    """The attributes of a span about one message."""
    attributes = peer_attributes(peer)
    attributes[MESSAGING_OPERATION_NAME] = operation
    attributes[MESSAGING_OPERATION_TYPE] = operation
    attributes[MESSAGING_DESTINATION_NAME] = destination.name
    attributes[DESTINATION_KIND] = destination.kind.value
    if destination.kind is DestinationKind.TEMPORARY_QUEUE:
        attributes[MESSAGING_DESTINATION_TEMPORARY] = True
    if message.message_id is not None:
        attributes[MESSAGING_MESSAGE_ID] = message.message_id
    if message.correlation_id is not None:
        attributes[MESSAGING_MESSAGE_CONVERSATION_ID] = message.correlation_id
    if operation != SEND:
        attributes[MESSAGE_REDELIVERED] = message.redelivered
        if message.delivery_count:
            attributes[MESSAGE_DELIVERY_COUNT] = message.delivery_count
    return attributes


def failover_attributes(peer: Peer, report: FailoverReport) -> dict[str, AttributeValue]:
    """A failover span's attributes: the report's figures, and the broker the connection is
    on after it (or, when it gave up, the one it lost)."""
    if report.code is ErrorCode.FAILOVER:
        outcome = "reattached" if report.reattached else "reconnected"
    else:
        outcome = "disconnected"
    attributes = peer_attributes(peer)
    attributes.update(
        {
            f"{FAILOVER}.outcome": outcome,
            f"{FAILOVER}.code": report.code.value,
            f"{FAILOVER}.reattached": report.reattached,
            f"{FAILOVER}.reason": report.reason,
            f"{FAILOVER}.from_broker": report.from_broker,
            f"{FAILOVER}.attempts": report.attempts,
            f"{FAILOVER}.duration": report.duration,
            f"{FAILOVER}.replayed": report.replayed,
            f"{FAILOVER}.resent": len(report.resent),
            f"{FAILOVER}.in_doubt": len(report.in_doubt),
            f"{FAILOVER}.stale_acks": len(report.stale_acks),
            f"{FAILOVER}.transactions_rolled_back": len(report.transactions_rolled_back),
        }
    )
    if report.to_broker is not None:
        attributes[f"{FAILOVER}.to_broker"] = report.to_broker
    lists: dict[str, tuple[str, ...] | tuple[int, ...]] = {
        "resent_ids": report.resent,
        "in_doubt_ids": report.in_doubt,
        "stale_ack_ids": report.stale_acks,
        "rolled_back_sessions": report.transactions_rolled_back,
        "degraded": report.degraded,
    }
    for name, values in lists.items():
        if values:
            attributes[f"{FAILOVER}.{name}"] = list(values[:MAX_IDS])
    return attributes


class _PropertiesGetter(Getter[Mapping[str, PropertyValue]]):
    """Reads a propagator's fields from a message's properties (text values only)."""

    def get(self, carrier: Mapping[str, PropertyValue], key: str) -> list[str] | None:
        value = carrier.get(key)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, PropertyValue]) -> list[str]:
        return list(carrier)


_GETTER: Final = _PropertiesGetter()


def context_of(
    message: Message, propagator: TextMapPropagator | None = None
) -> otel_context.Context:
    """The context a message carries (its creation context, and baggage), read with
    ``propagator`` (the global one by default); an empty one when it carries none."""
    textmap = propagator if propagator is not None else propagate.get_global_textmap()
    empty = otel_context.Context()
    if not any(field in message.properties for field in textmap.fields):
        return empty  # the common case of a send, and cheaper than extracting nothing
    return textmap.extract(message.properties, context=empty, getter=_GETTER)


def _span_context(context: otel_context.Context) -> SpanContext:
    return trace.get_current_span(context).get_span_context()


def _error_type(error: BaseException | type[BaseException]) -> str:
    kind = error if isinstance(error, type) else type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def _fail(span: Span, error: BaseException) -> None:
    span.set_attribute(ERROR_TYPE, _error_type(error))
    if isinstance(error, HaFailoverError):
        span.set_attribute(ERROR_CODE, error.code.value)
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


class _SendSpan:
    """A send's span, ended when the send completes."""

    __slots__ = ("_peer", "_span")

    def __init__(self, span: Span, peer: Peer) -> None:
        self._span = span
        self._peer = peer

    def end(self, error: BaseException | None, peer: Peer) -> None:
        span = self._span
        if peer != self._peer:
            span.set_attributes(peer_attributes(peer))  # it went out after a failover
        if error is not None:
            _fail(span, error)
        span.end()


class _Hooks:
    """The driver's tracing hooks, made of spans."""

    def __init__(self, tracer: trace.Tracer, propagator: TextMapPropagator | None) -> None:
        self._tracer = tracer
        self._propagator = propagator

    def _textmap(self) -> TextMapPropagator:
        # Looked up at each use, so a propagator set after instrumenting counts.
        return self._propagator if self._propagator is not None else propagate.get_global_textmap()

    def send(self, peer: Peer, destination: Destination, message: Message) -> _SendSpan:
        message.ensure_message_id()  # the id it is sent with: given here rather than later
        textmap = self._textmap()
        carried = _span_context(context_of(message, textmap))
        span = self._tracer.start_span(
            span_name(SEND, destination),
            kind=_KINDS[SEND],
            attributes=message_attributes(SEND, peer, destination, message),
            links=[Link(carried)] if carried.is_valid else None,
        )
        if not carried.is_valid:
            # The send span is the message's creation context; one the application put in
            # the message itself (a forwarded message's) is kept as it is.
            fields: dict[str, str] = {}
            textmap.inject(fields, context=trace.set_span_in_context(span))
            message.properties.update(fields)
        return _SendSpan(span, peer)

    @contextlib.contextmanager
    def receive(
        self, peer: Peer, destination: Destination, message: Message, started_ns: int
    ) -> Iterator[None]:
        created = _span_context(context_of(message, self._textmap()))
        span = self._tracer.start_span(
            span_name(RECEIVE, destination),
            kind=_KINDS[RECEIVE],
            attributes=message_attributes(RECEIVE, peer, destination, message),
            links=[Link(created)] if created.is_valid else None,
            start_time=started_ns,
        )
        try:
            yield
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            span.end()

    @contextlib.contextmanager
    def process(self, peer: Peer, destination: Destination, message: Message) -> Iterator[None]:
        carried = context_of(message, self._textmap())
        created = _span_context(carried)
        links = []
        token = None
        if created.is_valid:
            links.append(Link(created))
            ambient = trace.get_current_span().get_span_context()
            if ambient.is_valid:
                links.append(Link(ambient))  # the conventions keep the context it replaces
            token = otel_context.attach(carried)  # its baggage too
        try:
            with self._tracer.start_as_current_span(
                span_name(PROCESS, destination),
                kind=_KINDS[PROCESS],
                attributes=message_attributes(PROCESS, peer, destination, message),
                links=links,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    yield
                except BaseException as exc:
                    _fail(span, exc)
                    raise
        finally:
            if token is not None:
                otel_context.detach(token)

    def failover(self, peer: Peer, report: FailoverReport, ended_ns: int) -> None:
        started_ns = ended_ns - int(report.duration * 1e9)
        span = self._tracer.start_span(
            "failover",
            context=otel_context.Context(),  # a trace of its own
            kind=SpanKind.INTERNAL,
            attributes=failover_attributes(peer, report),
            start_time=started_ns,
        )
        if report.code is not ErrorCode.FAILOVER:
            span.set_attribute(ERROR_TYPE, _error_type(DisconnectedError))
            span.set_attribute(ERROR_CODE, report.code.value)
            span.set_status(Status(StatusCode.ERROR, report.summary()))
        span.end(end_time=ended_ns)


def process(consumer: Consumer, message: Message) -> contextlib.AbstractContextManager[None]:
    """A ``process`` span around code that handles what ``consumer.receive()`` returned,
    as a message listener's call gets one: a CONSUMER span, child of the message's creation
    context (and linked to it and to the caller's span). Does nothing when hafailover is
    not instrumented."""
    return tracing.processing(consumer, message)


_OPTIONS: Final = frozenset({"tracer_provider", "propagator"})
# What opentelemetry-instrument and distributions may pass to every instrumentor.
_IGNORED: Final = frozenset({"meter_provider", "logger_provider", "event_logger_provider"})


class HaFailoverInstrumentor(BaseInstrumentor):  # type: ignore[misc] # untyped base
    """Traces every hafailover connection of the process (see the module's text).

    ``instrument(tracer_provider=None, propagator=None)``: the tracer provider (default:
    the global one) and the propagator that puts the context in messages and reads it
    back (default: the global one, looked up at each message); ``uninstrument()`` stops.
    Like every OpenTelemetry instrumentor it is one object per process."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # hafailover traces itself: nothing else need be installed

    def _instrument(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _OPTIONS - _IGNORED)
        if unknown:
            raise ConfigurationError(
                f"unknown instrument() option(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(sorted(_OPTIONS))}"
            )
        provider = kwargs.get("tracer_provider")
        if provider is not None and not isinstance(provider, trace.TracerProvider):
            raise ConfigurationError(
                f"tracer_provider must be an opentelemetry TracerProvider, not {provider!r}"
            )
        propagator = kwargs.get("propagator")
        if propagator is not None and not isinstance(propagator, TextMapPropagator):
            raise ConfigurationError(
                f"propagator must be an opentelemetry TextMapPropagator, not {propagator!r}"
            )
        tracer = trace.get_tracer(__name__, __version__, provider)
        tracing.install(_Hooks(tracer, propagator))

    def _uninstrument(self, **kwargs: Any) -> None:
        tracing.install(None)
