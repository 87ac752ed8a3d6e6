"""The message an application sends and receives, the same on both protocols.

A ``Message`` is built by the application (body, properties, delivery options); a send
never changes it: what goes out is a copy carrying the message's id, given at its first
send and kept beside the object (it doubles as the duplicate id of a persistent send,
DESIGN.md F13, so re-sending the same message object after an unknown outcome or a
rolled-back transaction stores it once). Received messages carry the delivery fields.
Bad input is refused when the message is built, naming what was wrong.
Pure: no I/O; acknowledging a received message goes through the session that set its
``delivery`` token.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import attrs

from hafailover.destination import Destination, parse_destination
from hafailover.errors import ConfigurationError, IllegalStateError

__all__ = ["Message", "PropertyValue", "new_message_id"]

PropertyValue: TypeAlias = str | int | float | bool
# Bytes a message costs beyond its body and properties when sizing the confirmation window.
FRAME_OVERHEAD: Final = 128
_PROPERTY_TYPES: Final = (str, int, float, bool)


# A random prefix per process and a counter: unique across clients and restarts, and about
# twenty times cheaper than a uuid4 per message (no system call). No colons: a STOMP header
# value would need them escaped on every send.
_ID_PREFIX: Final = f"ID-{uuid.uuid4().hex}-"
_ID_COUNTER: Final = itertools.count(1)


def new_message_id() -> str:
    """A message id unique across clients and restarts."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER)}"


def _check_body(instance: Message, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bytes | str):
        raise ConfigurationError(f"a message body must be bytes or str, not {type(value).__name__}")


def _check_properties(
    instance: Message, attribute: attrs.Attribute[Any], value: Mapping[str, Any]
) -> None:
    for name, item in value.items():
        if not isinstance(name, str) or not name or any(c in name for c in "\x00\n\r"):
            raise ConfigurationError(
                f"property name {name!r} must be a non-empty string without NUL or line breaks"
            )
        if not isinstance(item, _PROPERTY_TYPES):
            raise ConfigurationError(
                f"property {name!r} has a {type(item).__name__} value; "
                "allowed: str, int, float, bool"
            )
        if isinstance(item, str) and "\x00" in item:
            raise ConfigurationError(f"property {name!r} may not hold NUL")


def _check_priority(instance: Message, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
        raise ConfigurationError(f"priority must be a whole number from 0 to 9, not {value!r}")


def _check_ttl(instance: Message, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"time_to_live must be seconds or None, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"time_to_live must be a positive number of seconds, not {value}")


def plain_property(value: PropertyValue) -> PropertyValue:
    """A property value as its base type, for the wire: a subclass of str, int or float (an
    enum) travels as its value, on both protocols, never as its ``str()`` (which is
    ``"Cls.MEMBER"`` for a ``(str, Enum)``)."""
    if type(value) in _PROPERTY_TYPES:  # the usual case, and every bool (bool has no subclasses)
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    return value


def _to_properties(value: Mapping[str, PropertyValue]) -> dict[str, PropertyValue]:
    # A copy: the application may go on changing the mapping it passed in.
    return dict(value)


def _to_destination(value: str | Destination | None) -> Destination | None:
    return None if value is None else parse_destination(value)


def stamps_duplicate_id(*, persistent: bool, duplicate_detection: bool) -> bool:
    """F13, decided here alone: a send carries its duplicate id (``_AMQ_DUPL_ID``) when it
    is persistent and the URL's duplicate_detection is on, so a resend after an unknown
    outcome is dropped by a broker that detects duplicates."""
    return persistent and duplicate_detection


@attrs.define(eq=False)
class Message:
    """One message. Build it with a body and options; read the rest after a receive."""

    body: bytes | str = attrs.field(default=b"", validator=_check_body)
    properties: dict[str, PropertyValue] = attrs.field(
        factory=dict, converter=_to_properties, validator=_check_properties
    )
    persistent: bool = True
    priority: int = attrs.field(default=4, validator=_check_priority)
    time_to_live: float | None = attrs.field(default=None, validator=_check_ttl)
    correlation_id: str | None = None
    reply_to: Destination | None = attrs.field(default=None, converter=_to_destination)
    message_id: str | None = None

    # Filled in on receipt.
    destination: Destination | None = None
    redelivered: bool = False
    delivery_count: int = 0
    # Set on receipt: ``message_id`` is the one its sender gave (it stays the same when the
    # message is delivered again, by this broker or by another after a failover).
    _sender_id: bool = attrs.field(default=False, repr=False, alias="sender_id")
    # The session's handle for acknowledge(); None on a message built by the application.
    delivery: Any = attrs.field(default=None, repr=False)
    _acknowledger: Any = attrs.field(default=None, repr=False, alias="acknowledger")
    _releaser: Any = attrs.field(default=None, repr=False, alias="releaser")

    @classmethod
    def of_body(cls, body: bytes | str, *, persistent: bool = True) -> Message:
        """A message with only a body (every other field at its default), made without
        running the validators: the type check below is all they would do. The send path
        makes one per send of a bare body."""
        if not isinstance(body, bytes | str):
            raise ConfigurationError(
                f"a message body must be bytes or str (or a Message), not {type(body).__name__}"
            )
        message = object.__new__(cls)
        for name, value in _DEFAULTS:
            object.__setattr__(message, name, value)
        object.__setattr__(message, "body", body)
        object.__setattr__(message, "properties", {})
        object.__setattr__(message, "persistent", persistent)
        return message

    @property
    def body_bytes(self) -> bytes:
        return self.body.encode("utf-8") if isinstance(self.body, str) else self.body

    @property
    def text(self) -> str:
        """The body as text (UTF-8)."""
        return self.body if isinstance(self.body, str) else self.body.decode("utf-8")

    def size(self) -> int:
        """Bytes this message weighs in the confirmation window (an estimate of its frame)."""
        total = len(self.body_bytes) + FRAME_OVERHEAD
        for name, value in self.properties.items():
            total += len(name) + len(str(value)) + 2
        return total

    def ensure_message_id(self) -> str:
        """Give the message an id at its first send and keep it for every later one."""
        if self.message_id is None:
            self.message_id = new_message_id()
        return self.message_id

    def acknowledge(self, *, confirm: bool = True) -> None:
        """CLIENT acknowledge modes: acknowledge this message (and, in CLIENT mode, every
        message its session delivered before it). Waits out a failover (F1), then for the
        broker's confirmation; with ``confirm=False`` it returns once the acknowledge is
        written: a failover that loses it then makes the broker deliver the message again,
        unreported (with the consumer's ``dedup`` window on, the message's id joins it as
        the acknowledge is written, so that copy is dropped). A write that fails raises
        AcknowledgeFailedError either way."""
        if self._acknowledger is None:
            raise IllegalStateError(
                "this message was built here, not received: there is nothing to acknowledge"
            )
        self._acknowledger(self, confirm)

    def release(self) -> None:
        """CLIENT_INDIVIDUAL: give this message back, alone, as a failed delivery (a STOMP
        NACK; on AMQP the modified outcome with delivery-failed): the broker raises its
        delivery count and delivers it again, to this consumer or another, or moves it to
        its dead-letter address once its count reaches the broker's limit; the consumer's
        ``max_redeliveries`` counts it too. Waits out a failover (F1); a message delivered
        before a reconnect cannot be released any more than acknowledged: the session
        recovers and StaleAcknowledge is raised (F8; the old broker session gave it back)."""
        if self._releaser is None:
            raise IllegalStateError(
                "this message was built here, not received: there is nothing to release"
            )
        self._releaser(self)


# Every field's default, for Message.of_body (the mutable one, properties, is made there).
_DEFAULTS: Final = tuple(
    (field.name, field.default)
    for field in attrs.fields(Message)
    if field.name not in ("body", "properties", "persistent")
)
