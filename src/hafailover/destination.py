"""Destinations, named the same way on both protocols.

``queue://orders`` and ``topic://prices`` (the Qpid JMS / ActiveMQ convention) are the
canonical names; the protocol-native forms are accepted too: ``/queue/orders``,
``/topic/prices`` and ``/temp-queue/x`` on STOMP, a bare address on AMQP (a queue), and
RabbitMQ's ``/amq/queue/orders``: a queue that exists already, which the broker is to use as it
is rather than declare (RabbitMQ declares a ``/queue/x`` on first use, and refuses that
declaration when the queue was made with other arguments, a quorum queue for one).
Each protocol adapter renders a destination in its own form. Pure: no I/O.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from hafailover.errors import ConfigurationError

__all__ = ["Destination", "DestinationKind", "parse_destination"]


class DestinationKind(enum.Enum):
    QUEUE = "queue"
    TOPIC = "topic"
    TEMPORARY_QUEUE = "temp-queue"


_CANONICAL: Final = {
    "queue://": DestinationKind.QUEUE,
    "topic://": DestinationKind.TOPIC,
    "temp-queue://": DestinationKind.TEMPORARY_QUEUE,
}
_STOMP: Final = {
    "/queue/": DestinationKind.QUEUE,
    "/topic/": DestinationKind.TOPIC,
    "/temp-queue/": DestinationKind.TEMPORARY_QUEUE,
}
_EXISTING_QUEUE: Final = "/amq/queue/"
_ACCEPTED: Final = (
    "queue://NAME",
    "topic://NAME",
    "/queue/NAME",
    "/topic/NAME",
    "/amq/queue/NAME",
    "NAME",
)
_MAX_NAME: Final = 255


@attrs.frozen
class Destination:
    """A queue, topic or temporary queue, by name. ``existing``: a queue to be used as it is,
    never declared (RabbitMQ's ``/amq/queue/NAME``)."""

    kind: DestinationKind
    name: str
    existing: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.existing and self.kind is not DestinationKind.QUEUE:
            raise ConfigurationError(
                f"only a queue can be an existing queue ({_EXISTING_QUEUE}NAME), "
                f"not a {self.kind.value}"
            )
        if not self.name or len(self.name) > _MAX_NAME:
            raise ConfigurationError(
                f"destination name {self.name!r} must have 1 to {_MAX_NAME} characters"
            )
        if any(c in self.name for c in "\x00\n\r") or self.name != self.name.strip():
            raise ConfigurationError(
                f"destination name {self.name!r} may not hold NUL, line breaks or "
                "surrounding spaces"
            )

    @classmethod
    def queue(cls, name: str) -> Destination:
        return cls(DestinationKind.QUEUE, name)

    @classmethod
    def topic(cls, name: str) -> Destination:
        return cls(DestinationKind.TOPIC, name)

    @property
    def is_topic(self) -> bool:
        return self.kind is DestinationKind.TOPIC

    def __str__(self) -> str:
        if self.existing:
            return f"{_EXISTING_QUEUE}{self.name}"
        return f"{self.kind.value}://{self.name}"

    @property
    def stomp(self) -> str:
        """The STOMP destination header value (RabbitMQ's AMQP 1.0 plugin takes it too)."""
        if self.kind is DestinationKind.TEMPORARY_QUEUE:
            return str(self)  # a broker-wide temporary queue address is sent as it is
        if self.existing:
            return f"{_EXISTING_QUEUE}{self.name}"
        return f"/{self.kind.value}/{self.name}"

    @property
    def amqp(self) -> str:
        """The AMQP 1.0 address (the canonical form, which the reference broker and
        Artemis both understand; a bare name means a queue). Brokers other than RabbitMQ
        declare nothing on attach, so an existing queue is a queue there."""
        return f"{self.kind.value}://{self.name}"


def parse_destination(text: str | Destination) -> Destination:
    """Parse a destination in canonical or protocol-native form.

    Raises ConfigurationError (a ValueError) naming the text and the accepted forms.
    """
    if isinstance(text, Destination):
        return text
    if not isinstance(text, str):
        raise ConfigurationError(
            f"a destination must be a string or Destination, not {type(text).__name__}"
        )
    if text.startswith(_EXISTING_QUEUE):
        name = text[len(_EXISTING_QUEUE) :]
        if not name:
            raise ConfigurationError(
                f"destination {text!r} names no queue (accepted: {', '.join(_ACCEPTED)})"
            )
        return Destination(DestinationKind.QUEUE, name, existing=True)
    for prefixes in (_CANONICAL, _STOMP):
        for prefix, kind in prefixes.items():
            if text.startswith(prefix):
                name = text[len(prefix) :]
                if not name:
                    raise ConfigurationError(
                        f"destination {text!r} names no queue or topic "
                        f"(accepted: {', '.join(_ACCEPTED)})"
                    )
                return Destination(kind, name)
    if "://" in text or text.startswith("/"):
        raise ConfigurationError(
            f"unknown destination form {text!r} (accepted: {', '.join(_ACCEPTED)})"
        )
    return Destination(DestinationKind.QUEUE, text)
