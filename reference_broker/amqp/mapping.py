"""Translation between AMQP 1.0 messages and addresses and the engine's, in both directions.

This module owns three rules of the AMQP server: how an AMQP address names an engine
address, how an AMQP message becomes an engine send (and an engine delivery an AMQP
message), and which AMQP error condition names each broker error. It never touches a
connection, a link or the engine's state; it only converts values, so that the rules can be
tested without a socket.

Addresses. ``queue://x`` and ``topic://x`` name what they say, bare ``x`` is a queue (the
Qpid JMS convention) unless the terminus carries the capability ``topic``, and the STOMP
forms ``/queue/x`` and ``/topic/x`` are accepted too. ``temp-queue://...`` is what a dynamic
node is called, and is used as it is.

Messages. The engine keeps a body (bytes) and string headers, so that STOMP and AMQP
clients can exchange messages. The mapping is lossless for what AMQP clients commonly send:

- body: a data section is kept as bytes and delivered as a data section; an amqp-value
  string is kept as UTF-8 and delivered as a string; any other amqp-value (null, a map, a
  list, a number) or an amqp-sequence is kept in its AMQP encoding and delivered as it came.
  The header ``hafailover-amqp-body`` (``string``, ``value`` or ``sequence``) says which;
  without it the body is bytes, which is what a STOMP producer sends.
- header section: durable -> persistent, priority (0-255, capped at the engine's 9),
  ttl and absolute-expiry-time -> one absolute expiration (the earlier of the two). On
  delivery, delivery-count is the engine's failed-attempt count and first-acquirer is false
  for a message that may have been seen before.
- properties section: the fields below travel as headers named the way STOMP names them,
  so that request/reply works across the two protocols; on delivery a message without a
  ``message-id`` header gets the broker's ``node:id``.
- application properties travel as headers. A STOMP header has no type, so values are kept
  as text (``true``/``false`` for booleans) and are delivered as strings.
- duplicate detection (DESIGN F13): the application property ``_AMQ_DUPL_ID`` is the
  duplicate id, as on Artemis, and is delivered with the message (over STOMP as a header).
  The message-id is not: many producers reuse message-ids (a counter per connection), and
  taking one for a duplicate id drops their messages silently. Only a broker started with
  ``--amqp-message-id-duplicates`` takes a durable message's message-id when there is no
  ``_AMQ_DUPL_ID`` (``message_id_duplicates``).
- message annotations and delivery annotations are not kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final

import attrs
from proton import Condition, Data, Message, ProtonException, symbol

from reference_broker.engine import (
    QUEUE_PREFIX,
    TEMP_QUEUE_PREFIX,
    TOPIC_PREFIX,
    AddressFullError,
    DiskFullError,
    UnknownTransactionError,
)
from reference_broker.message import (
    MAX_PRIORITY,
    BrokerError,
    InvalidRequestError,
    NotFoundError,
    ResourceLockedError,
)
from reference_broker.message import Message as EngineMessage

__all__ = [
    "BODY_HEADER",
    "DUPLICATE_ID_PROPERTY",
    "DecodeError",
    "IncomingMessage",
    "NotImplementedByBrokerError",
    "amqp_address",
    "condition_for",
    "decode_incoming",
    "encode_delivery",
]

DUPLICATE_ID_PROPERTY: Final = "_AMQ_DUPL_ID"
BODY_HEADER: Final = "hafailover-amqp-body"
_BODY_STRING: Final = "string"
_BODY_VALUE: Final = "value"
_BODY_SEQUENCE: Final = "sequence"

# properties-section field -> engine header (STOMP's names where STOMP has one).
_MESSAGE_ID: Final = "message-id"
_CORRELATION_ID: Final = "correlation-id"
_REPLY_TO: Final = "reply-to"
_CONTENT_TYPE: Final = "content-type"
_CONTENT_ENCODING: Final = "content-encoding"
_SUBJECT: Final = "subject"
_GROUP_ID: Final = "group-id"
_TIMESTAMP: Final = "timestamp"  # creation-time, in milliseconds as ActiveMQ's STOMP has it
_RESERVED: Final = frozenset(
    {
        BODY_HEADER,
        _MESSAGE_ID,
        _CORRELATION_ID,
        _REPLY_TO,
        _CONTENT_TYPE,
        _CONTENT_ENCODING,
        _SUBJECT,
        _GROUP_ID,
        _TIMESTAMP,
    }
)
# STOMP framing headers that a STOMP producer's message carries but that mean nothing here.
_STOMP_ONLY: Final = frozenset({"content-length", "destination", "receipt"})

_STOMP_QUEUE: Final = "/queue/"
_STOMP_TOPIC: Final = "/topic/"
_CANONICAL: Final = (QUEUE_PREFIX, TOPIC_PREFIX, TEMP_QUEUE_PREFIX)


class DecodeError(InvalidRequestError):
    """A transfer that is not a valid AMQP message."""

    code: ClassVar[str] = "DECODE_ERROR"


class NotImplementedByBrokerError(InvalidRequestError):
    """A valid request for something this broker does not do (selectors, distributed
    transactions)."""

    code: ClassVar[str] = "NOT_IMPLEMENTED"


# --- addresses --------------------------------------------------------------------------------


def amqp_address(address: str, capabilities: Iterable[str] = ()) -> str:
    """The engine address an AMQP terminus address names."""
    if not address:
        raise InvalidRequestError("an empty address names nothing")
    if address.startswith(_CANONICAL):
        return address
    if address.startswith(_STOMP_QUEUE) and len(address) > len(_STOMP_QUEUE):
        return QUEUE_PREFIX + address[len(_STOMP_QUEUE) :]
    if address.startswith(_STOMP_TOPIC) and len(address) > len(_STOMP_TOPIC):
        return TOPIC_PREFIX + address[len(_STOMP_TOPIC) :]
    if "topic" in capabilities:
        return TOPIC_PREFIX + address
    return QUEUE_PREFIX + address


# --- AMQP -> engine ---------------------------------------------------------------------------


@attrs.frozen
class IncomingMessage:
    """What ``Engine.send`` needs from one AMQP message."""

    to: str | None
    body: bytes
    headers: dict[str, str]
    persistent: bool
    priority: int
    expiration: float | None
    duplicate_id: str | None


def _id_text(value: object) -> str:
    """message-id and correlation-id as text: a string as it is, others in their usual form."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)


def _property_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return str(value)


def _encode_value(value: object) -> bytes:
    data = Data()
    data.put_object(value)
    return data.encode()


def decode_incoming(
    payload: bytes, now: float, *, message_id_duplicates: bool = False
) -> IncomingMessage:
    """Decode a transfer's payload into an engine send; DecodeError if it is not a message.
    With ``message_id_duplicates`` a durable message's message-id is its duplicate id when
    it carries no ``_AMQ_DUPL_ID``."""
    message = Message()
    try:
        message.decode(payload)
        return _incoming(message, now, message_id_duplicates=message_id_duplicates)
    except (ProtonException, KeyError, TypeError, ValueError, UnicodeError) as exc:
        if isinstance(exc, BrokerError):
            raise
        raise DecodeError(f"not a valid AMQP message: {exc}") from None


def _incoming(message: Message, now: float, *, message_id_duplicates: bool) -> IncomingMessage:
    headers: dict[str, str] = {}
    duplicate_id: str | None = None
    properties = message.properties
    if properties:
        for key, value in properties.items():
            if value is None:
                continue
            if key == DUPLICATE_ID_PROPERTY:
                duplicate_id = _property_text(value)
            headers[str(key)] = _property_text(value)
    body = message.body
    if isinstance(body, bytes | memoryview):
        raw = bytes(body)
    elif isinstance(body, str):
        raw = body.encode("utf-8")
        headers[BODY_HEADER] = _BODY_STRING
    else:
        raw = _encode_value(body)
        # proton decodes an amqp-sequence as a list with the inferred flag set.
        sequence = isinstance(body, list) and message.inferred
        headers[BODY_HEADER] = _BODY_SEQUENCE if sequence else _BODY_VALUE
    message_id = message.id
    if message_id is not None:
        headers[_MESSAGE_ID] = _id_text(message_id)
    if message.correlation_id is not None:
        headers[_CORRELATION_ID] = _id_text(message.correlation_id)
    for header, value in (
        (_REPLY_TO, message.reply_to),
        (_CONTENT_TYPE, message.content_type),
        (_CONTENT_ENCODING, message.content_encoding),
        (_SUBJECT, message.subject),
        (_GROUP_ID, message.group_id),
    ):
        if value:
            headers[header] = str(value)
    if message.creation_time:
        headers[_TIMESTAMP] = str(round(message.creation_time * 1000))
    persistent = message.durable
    if duplicate_id is None and message_id_duplicates and persistent and message_id is not None:
        duplicate_id = _id_text(message_id)
    expirations = []
    if message.ttl:
        expirations.append(now + message.ttl)
    if message.expiry_time:
        expirations.append(message.expiry_time)
    return IncomingMessage(
        to=message.address or None,
        body=raw,
        headers=headers,
        persistent=persistent,
        priority=min(message.priority, MAX_PRIORITY),
        expiration=min(expirations) if expirations else None,
        duplicate_id=duplicate_id,
    )


# --- engine -> AMQP ---------------------------------------------------------------------------


def _decode_value(raw: bytes) -> Any:  # whatever AMQP value the body held
    data = Data()
    data.decode(raw)
    data.rewind()
    data.next()
    return data.get_object()


def encode_delivery(
    message: EngineMessage,
    *,
    delivery_count: int,
    redelivered: bool,
    node_id: str,
    now: float,
) -> bytes:
    """The AMQP encoding of one delivery of ``message``."""
    headers: Mapping[str, str] = message.headers
    out = Message()
    kind = headers.get(BODY_HEADER)
    try:
        if kind == _BODY_STRING:
            out.body = message.body.decode("utf-8")
        elif kind in (_BODY_VALUE, _BODY_SEQUENCE):
            out.body = _decode_value(message.body)
            out.inferred = kind == _BODY_SEQUENCE
        else:
            out.body = message.body
            out.inferred = True  # bytes as a data section
    except (ProtonException, UnicodeError):
        # A header that lies about the body (a STOMP client may set any header): send bytes.
        out.body = message.body
        out.inferred = True
    out.durable = message.persistent
    out.priority = message.priority
    out.delivery_count = delivery_count
    out.first_acquirer = not redelivered
    if message.expiration is not None:
        out.expiry_time = message.expiration
        out.ttl = max(message.expiration - now, 0.001)
    out.address = message.address
    out.id = headers.get(_MESSAGE_ID) or f"{node_id}:{message.id}"
    correlation_id = headers.get(_CORRELATION_ID)
    if correlation_id is not None:
        out.correlation_id = correlation_id
    if (value := headers.get(_REPLY_TO)) is not None:
        out.reply_to = value
    if (value := headers.get(_CONTENT_TYPE)) is not None:
        out.content_type = symbol(value)
    if (value := headers.get(_CONTENT_ENCODING)) is not None:
        out.content_encoding = symbol(value)
    if (value := headers.get(_SUBJECT)) is not None:
        out.subject = value
    if (value := headers.get(_GROUP_ID)) is not None:
        out.group_id = value
    if (value := headers.get(_TIMESTAMP)) is not None and value.isdigit():
        out.creation_time = int(value) / 1000.0
    properties = {k: v for k, v in headers.items() if k not in _RESERVED and k not in _STOMP_ONLY}
    if properties:
        # proton annotates Message.properties by its None default only.
        out.properties = dict(properties)  # type: ignore[assignment]
    return out.encode()


# --- errors -----------------------------------------------------------------------------------

_CONDITIONS: Final[tuple[tuple[type[BrokerError], str], ...]] = (
    (UnknownTransactionError, "amqp:transaction:unknown-id"),
    (DecodeError, "amqp:decode-error"),
    (NotImplementedByBrokerError, "amqp:not-implemented"),
    (NotFoundError, "amqp:not-found"),
    (ResourceLockedError, "amqp:resource-locked"),
    (DiskFullError, "amqp:resource-limit-exceeded"),  # as Artemis says "address full"
    (AddressFullError, "amqp:resource-limit-exceeded"),
    (InvalidRequestError, "amqp:invalid-field"),
)
CODE_KEY: Final = symbol("hafailover-code")


def condition_for(error: BrokerError) -> Condition:
    """The AMQP error condition for a broker error: its text, and its code in the info map."""
    name = "amqp:internal-error"
    for kind, candidate in _CONDITIONS:
        if isinstance(error, kind):
            name = candidate
            break
    return Condition(name, str(error)[:1000], {CODE_KEY: error.code})
