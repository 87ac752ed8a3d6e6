"""The broker's message value and the broker's error root.

This module owns two things every other broker module needs and that depend on nothing:
the immutable `Message` (what a producer sent, once the broker has given it an id) and
`BrokerError`, the one root of every error the broker raises, so that a protocol layer can
catch one class and forward `code` and the message text in a STOMP ERROR frame or an AMQP
error condition.

What a message is *not*: its delivery state. How many times it was delivered, and whether it
was redelivered, belong to its place in one queue (a topic gives each subscription its own
copy of that state), so the engine keeps them next to the message, never in it. A `Message`
is therefore shared, unchanged, by every queue it was routed to.

This module must never import the engine, the journal or a protocol: it sits at the bottom.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Final

import attrs

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "NO_HEADERS",
    "BrokerError",
    "InvalidRequestError",
    "Message",
    "NotFoundError",
    "ResourceLockedError",
]

#: JMS and AMQP both default to 4 on a 0-9 scale.
DEFAULT_PRIORITY: Final = 4
MAX_PRIORITY: Final = 9

#: Shared by every message sent without headers: read-only, so sharing is safe.
NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})


class BrokerError(Exception):
    """Root of every error the reference broker raises.

    `code` is machine-readable and stable; the text names what was wrong so that it can be
    sent to the client as it is.
    """

    code: ClassVar[str] = "BROKER_ERROR"


class InvalidRequestError(BrokerError, ValueError):
    """A request the broker cannot carry out as asked: a malformed name, a bad value, a
    transaction used on the wrong connection."""

    code: ClassVar[str] = "INVALID_REQUEST"


class NotFoundError(BrokerError, LookupError):
    """A name or id that the broker does not know (any more)."""

    code: ClassVar[str] = "NOT_FOUND"


class ResourceLockedError(BrokerError, PermissionError):
    """The thing exists but belongs to someone else or is in use (a temporary queue of another
    connection, a durable subscription with active consumers)."""

    code: ClassVar[str] = "RESOURCE_LOCKED"


# Frozen but without attrs validators: a message is built once per send on the hot path, and
# every field is checked where it enters the broker (Engine.send, records.decode), so checking
# it a second time here would cost without protecting anything.
@attrs.frozen
class Message:
    """One message as stored by the broker.

    `id` is broker-assigned and unique on this node; `address` is the canonical address the
    producer sent to (`queue://orders`, `topic://prices`, `temp-queue://...`). `headers` is
    treated as read-only: the engine takes ownership of the mapping it is given.
    `expiration` is an absolute time on the caller's clock (the same clock as the `now`
    passed to the engine), or None for never.
    """

    id: int
    address: str
    body: bytes
    # A dict is not hashable; leaving it out of the hash keeps equal messages hashing equal.
    headers: Mapping[str, str] = attrs.field(default=NO_HEADERS, hash=False)
    persistent: bool = False
    priority: int = DEFAULT_PRIORITY
    expiration: float | None = None

    def is_expired(self, now: float) -> bool:
        """True when the message must no longer be delivered at time `now`."""
        return self.expiration is not None and self.expiration <= now
