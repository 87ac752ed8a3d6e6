"""The AMQP 1.0 encoding of hafailover's messages, and the codes of the performatives and
delivery states the engine writes and reads (AMQP 1.0 parts 3.4 and 4.5).

Pure: no I/O. A message is encoded directly (the few sections a send has, as proton writes
them) and decoded by proton; proton encodes only what the direct encoding does not take.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import cproton
import proton
from proton import symbol

from hafailover.destination import Destination, parse_destination
from hafailover.message import Message, PropertyValue, plain_property, stamps_duplicate_id

__all__ = ["DUPLICATE_ID", "decode_message", "encode_message"]

DUPLICATE_ID: Final = "_AMQ_DUPL_ID"

# Transaction performatives and delivery states (AMQP 1.0 part 4.5).
DECLARE: Final = symbol("amqp:declare:list")
DISCHARGE: Final = symbol("amqp:discharge:list")
LOCAL_TRANSACTIONS: Final = symbol("amqp:local-transactions")
# A source capability: the subscription is shared by every link that names it (Qpid JMS).
SHARED: Final = symbol("shared")
DECLARED: Final = 0x33
TRANSACTIONAL_STATE: Final = 0x34
ACCEPTED: Final = 0x24
REJECTED: Final = 0x25
RELEASED: Final = 0x26
MODIFIED: Final = 0x27
OUTCOME_NAMES: Final = {
    ACCEPTED: "accepted",
    REJECTED: "rejected",
    RELEASED: "released",
    MODIFIED: "modified",
    "amqp:accepted:list": "accepted",
    "amqp:rejected:list": "rejected",
    "amqp:released:list": "released",
    "amqp:modified:list": "modified",
}
UNAUTHORIZED: Final = "amqp:unauthorized-access"
_TEMP_QUEUE_PREFIX: Final = "temp-queue://"


def _encode(message: proton.Message, estimate: int) -> bytes:
    """proton.Message.encode(), starting from a size estimate: proton starts at 16 bytes and
    doubles, so a 1 KiB message took eight encodings. Falls back to encode() if proton's
    internals are not what this expects."""
    pre_encode = getattr(message, "_pre_encode", None)
    raw = getattr(message, "_msg", None)
    if pre_encode is None or raw is None:
        return bytes(message.encode())
    pre_encode()
    size = max(estimate, 64)
    while True:
        err, data = cproton.pn_message_encode(raw, size)
        if err == cproton.PN_OVERFLOW:
            size *= 2
            continue
        if err < 0:
            return bytes(message.encode())  # let proton raise its own error
        return bytes(data)


def encode_message(
    message: Message, address: str, *, reply_to: str | None, duplicate_detection: bool
) -> bytes:
    """The AMQP encoding of ``message`` sent to ``address`` (its id is given here if it has
    none yet: the message-id is the duplicate id on AMQP, DESIGN F13).

    Written directly, byte for byte what proton writes (tests/adapters/test_amqp_codec.py
    compares the two): a ``proton.Message`` set field by field through proton's binding cost
    a Celery task's send about 120 us, most of what made an AMQP 1.0 send dearer than a STOMP
    one. What the direct encoding does not take goes through proton, which writes it or
    raises its own error: an id that is not a string (proton writes an integer, a UUID or
    bytes as their AMQP types), an integer beyond 64 bits, a string that is not UTF-8, a
    time to live of 2**32 ms or more, a body of 4 GiB or more."""
    message_id = message.ensure_message_id()
    # proton picks an encoder by exact type: str and int subclasses (enums) become plain ones.
    properties: dict[str, PropertyValue] = {
        str(k): plain_property(v) for k, v in message.properties.items()
    }
    if stamps_duplicate_id(persistent=message.persistent, duplicate_detection=duplicate_detection):
        properties[DUPLICATE_ID] = message_id  # Artemis reads this one
    correlation_id = message.correlation_id
    if type(message_id) is str and (correlation_id is None or type(correlation_id) is str):
        try:
            return _sections(message, message_id, address, reply_to, properties)
        except (UnicodeEncodeError, struct.error):
            pass
    return _encode_with_proton(message, message_id, address, reply_to, properties)


def _encode_with_proton(
    message: Message,
    message_id: str,
    address: str,
    reply_to: str | None,
    properties: dict[str, PropertyValue],
) -> bytes:
    """``encode_message`` through a ``proton.Message``: the reference the direct encoding is
    tested against, and the way for what that one does not take."""
    out = proton.Message()
    if isinstance(message.body, str):
        out.body = message.body  # an amqp-value string: a text message
    else:
        out.body = message.body
        out.inferred = True  # a data section: a bytes message
    out.durable = message.persistent
    out.priority = message.priority
    if message.time_to_live is not None:
        out.ttl = message.time_to_live
    out.id = message_id
    if message.correlation_id is not None:
        out.correlation_id = message.correlation_id
    if reply_to is not None:
        out.reply_to = reply_to
    out.address = address
    if properties:
        out.properties = properties  # type: ignore[assignment] # proton annotates only None
    # Strings are most of a message's properties (a kombu envelope is ~1 KiB of JSON): their
    # length is in the estimate, so one encoding is enough.
    estimate = 256 + len(message.body_bytes) + 64 * len(properties)
    estimate += sum(len(v) for v in properties.values() if isinstance(v, str))
    return _encode(out, estimate)


# --- the direct encoding (AMQP 1.0 part 1.6 types, part 3.2 sections) -------------------------

_NULL: Final = b"\x40"
_TRUE: Final = b"\x41"
_FALSE: Final = b"\x42"
_EMPTY_LIST: Final = b"\x45"
# A section: the descriptor constructor 0x00, then smallulong 0x53 and the section's code.
_HEADER: Final = b"\x00\x53\x70"
_PROPERTIES: Final = b"\x00\x53\x73"
_APPLICATION_PROPERTIES: Final = b"\x00\x53\x74"
_DATA: Final = b"\x00\x53\x75"
_AMQP_VALUE: Final = b"\x00\x53\x77"
_DEFAULT_PRIORITY: Final = 4  # the header's default, which proton leaves out
_pack_byte_and_int = struct.Struct(">BI").pack
_pack_list8 = struct.Struct(">BBB").pack
_pack_compound32 = struct.Struct(">BII").pack
_pack_small = struct.Struct(">BB").pack
_pack_smalllong = struct.Struct(">Bb").pack
_pack_long = struct.Struct(">Bq").pack
_pack_double = struct.Struct(">Bd").pack


def _variable(small: int, large: int, data: bytes) -> bytes:
    """A string (0xa1/0xb1) or binary (0xa0/0xb0): the one-byte length up to 255 bytes."""
    n = len(data)
    return _pack_small(small, n) + data if n < 256 else _pack_byte_and_int(large, n) + data


def _string(value: str) -> bytes:
    return _variable(0xA1, 0xB1, value.encode("utf-8"))


def _list(fields: list[bytes]) -> bytes:
    """A list of encoded fields, trailing nulls left out (proton does); list8 while its size
    and count fit a byte."""
    while fields and fields[-1] is _NULL:
        fields.pop()
    if not fields:
        return _EMPTY_LIST
    body = b"".join(fields)
    if len(body) < 255 and len(fields) < 256:
        return _pack_list8(0xC0, len(body) + 1, len(fields)) + body
    return _pack_compound32(0xD0, len(body) + 4, len(fields)) + body


def _property_value(value: PropertyValue) -> bytes:
    """As proton's ``put_object`` writes a property: bool, long (smalllong when it fits a
    byte), double, string."""
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    if isinstance(value, int):
        return _pack_smalllong(0x55, value) if -128 <= value <= 127 else _pack_long(0x81, value)
    if isinstance(value, float):
        return _pack_double(0x82, value)
    return _string(value)


def _sections(
    message: Message,
    message_id: str,
    address: str,
    reply_to: str | None,
    properties: dict[str, PropertyValue],
) -> bytes:
    """header, properties, application-properties and the body, as proton writes them."""
    ttl = 0 if message.time_to_live is None else int(message.time_to_live * 1000)
    header = [
        _TRUE if message.persistent else _NULL,
        _NULL if message.priority == _DEFAULT_PRIORITY else _pack_small(0x50, message.priority),
        _NULL
        if ttl == 0
        else _pack_small(0x52, ttl)
        if ttl < 256
        else _pack_byte_and_int(0x70, ttl),
    ]
    fields = [
        _string(message_id),
        _NULL,  # user-id
        _string(address),
        _NULL,  # subject
        _NULL if reply_to is None else _string(reply_to),
        _NULL if message.correlation_id is None else _string(message.correlation_id),
    ]
    parts = [_HEADER, _list(header), _PROPERTIES, _list(fields)]
    if properties:
        entries = b"".join(_string(k) + _property_value(v) for k, v in properties.items())
        parts += [
            _APPLICATION_PROPERTIES,
            _pack_compound32(0xD1, len(entries) + 4, 2 * len(properties)),
            entries,
        ]
    body = message.body
    if isinstance(body, str):
        parts += [_AMQP_VALUE, _string(body)]
    else:
        parts += [_DATA, _variable(0xA0, 0xB0, bytes(body))]
    return b"".join(parts)


def _id_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return str(value)


def _property_in(value: object) -> PropertyValue | None:
    # proton's own subclasses (symbol, char, ulong, timestamp, ...) become the plain types.
    if value is None:
        return None
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    if isinstance(value, bool | int | float | str):
        return plain_property(value)
    return str(value)


def _valid_property_name(name: object) -> bool:
    return isinstance(name, str) and bool(name) and not any(c in name for c in "\x00\n\r")


def _body_in(body: object) -> bytes | str:
    if isinstance(body, str):
        return str(body)
    if isinstance(body, bytes | memoryview | bytearray):
        return bytes(body)
    if body is None:
        return b""
    # A map, list or number: kept in its AMQP encoding, which the caller can decode.
    data = proton.Data()
    data.put_object(body)
    encoded: bytes = data.encode()
    return encoded


def _destination_in(address: str | None) -> Destination | None:
    if not address:
        return None
    try:
        return parse_destination(address)
    except ValueError:
        return None  # a broker-specific form this client does not model


def decode_message(payload: bytes, *, fallback: Destination | None = None) -> Message:
    """A received transfer as a Message (``fallback``: the subscribed destination, used when
    the message names none)."""
    incoming = proton.Message()
    incoming.decode(payload)
    properties: dict[str, PropertyValue] = {}
    received: dict[Any, Any] = incoming.properties or {}
    for name, value in received.items():
        converted = _property_in(value)
        if converted is not None and _valid_property_name(name) and name != DUPLICATE_ID:
            properties[str(name)] = converted
    stamped = received.get(DUPLICATE_ID)
    duplicate_id = str(stamped) if isinstance(stamped, str) and stamped else None
    ttl = incoming.ttl
    correlation_id = _id_text(incoming.correlation_id)
    delivery_count = int(incoming.delivery_count)
    return Message(
        body=_body_in(incoming.body),
        properties=properties,
        persistent=bool(incoming.durable),
        priority=min(max(int(incoming.priority), 0), 9),
        time_to_live=ttl if ttl and ttl > 0 else None,
        correlation_id=correlation_id,
        reply_to=_destination_in(incoming.reply_to),
        # The duplicate id its sender stamped, when it did: the same on every broker and at
        # every delivery (a broker may give a message without a message-id one of its own).
        message_id=duplicate_id if duplicate_id is not None else _id_text(incoming.id),
        sender_id=duplicate_id is not None,
        destination=_destination_in(incoming.address) or fallback,
        redelivered=delivery_count > 0 or not incoming.first_acquirer,
        delivery_count=delivery_count,
    )
