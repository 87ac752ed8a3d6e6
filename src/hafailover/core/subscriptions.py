"""Named topic subscriptions (JMS durable and shared ones) and the redelivery limit.

A named subscription outlives its consumers on the broker (durable) or is shared by several
consumers (shared), and is found again by its name after a failover, a reattach or a
restart: the recreation (F5) subscribes under the same name and the broker resumes it. This
module owns what a subscription is called on the broker, the JMS rules about which named
subscriptions one connection may hold open at once, and when a message has failed so often
that a consumer rejects it to the dead-letter address instead of handing it out again.

Names on the broker: with a client id, ``<client id>.<name>`` (Artemis names the queue of a
STOMP durable subscription the same way); without one, ``<name>``, which only a shared
subscription may do (JMS 2.0: a shared subscription without a client id is global).

Pure: no threads, clocks or I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

import attrs

from hafailover.destination import Destination
from hafailover.errors import ConfigurationError, IllegalStateError

__all__ = [
    "NamedSubscription",
    "RedeliveryLimit",
    "SubscriptionKind",
    "broker_subscription_name",
    "check_can_open",
    "check_can_unsubscribe",
    "named_subscription",
]

_MAX_NAME: Final = 200
_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class SubscriptionKind(enum.Enum):
    DURABLE = "durable"  # one active consumer at a time, kept while none is attached
    SHARED = "shared"  # many consumers share the messages, gone with the last of them
    SHARED_DURABLE = "shared durable"  # many consumers, kept while none is attached


@attrs.frozen
class NamedSubscription:
    """A durable or shared subscription to ``topic``, as the application named it."""

    kind: SubscriptionKind
    name: str
    client_id: str | None

    @property
    def durable(self) -> bool:
        return self.kind is not SubscriptionKind.SHARED

    @property
    def shared(self) -> bool:
        return self.kind is not SubscriptionKind.DURABLE

    @property
    def broker_name(self) -> str:
        """The subscription's name on the broker (the module's header says why)."""
        return broker_subscription_name(self.name, self.client_id)


def broker_subscription_name(name: str, client_id: str | None) -> str:
    return name if client_id is None else f"{client_id}.{name}"


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a subscription name must be a non-empty string, not {name!r}")
    if len(name) > _MAX_NAME or not set(name) <= _NAME_CHARS:
        raise ConfigurationError(
            f"subscription name {name!r} must be 1 to {_MAX_NAME} letters, digits, '-', '_' or '.'"
        )
    return name


def named_subscription(
    kind: SubscriptionKind, topic: Destination, name: object, client_id: str | None
) -> NamedSubscription:
    """Check what the application asked for; a clear error names what is wrong."""
    checked = _check_name(name)
    if not topic.is_topic:
        raise ConfigurationError(f"a {kind.value} subscription is to a topic, not to {topic}")
    if kind is SubscriptionKind.DURABLE and client_id is None:
        raise ConfigurationError(
            f"durable subscription {checked!r} is not shared, so it needs a client id: add "
            "client_id=<id> to the URL, or use create_shared_durable_consumer"
        )
    return NamedSubscription(kind, checked, client_id)


def check_can_open(
    wanted: NamedSubscription,
    topic: Destination,
    selector: str | None,
    open_now: Iterable[tuple[NamedSubscription, Destination, str | None]],
) -> None:
    """The JMS rules for a consumer on ``wanted``, given the named subscriptions this
    connection has consumers on: a subscription that is not shared has at most one active
    consumer; a shared one is shared only by consumers that agree on its kind, topic and
    selector. Raises IllegalStateError naming the conflict."""
    for other, other_topic, other_selector in open_now:
        if other.broker_name != wanted.broker_name:
            continue
        what = f"subscription {wanted.name!r}"
        if not wanted.shared or not other.shared:
            raise IllegalStateError(
                f"{what} already has an active consumer on this connection, and a "
                "subscription that is not shared may have only one"
            )
        if other.kind is not wanted.kind:
            raise IllegalStateError(
                f"{what} is open as {other.kind.value}, not {wanted.kind.value}"
            )
        if other_topic != topic or other_selector != selector:
            raise IllegalStateError(
                f"{what} is open on {other_topic} with selector {other_selector!r}; a shared "
                "subscription cannot change its topic or selector while it has consumers"
            )


def check_can_unsubscribe(name: str, open_now: Iterable[NamedSubscription]) -> str:
    """The broker name of the durable subscription ``unsubscribe(name)`` deletes; JMS
    forbids it while this connection has a consumer on it."""
    checked = _check_name(name)
    for other in open_now:
        if other.name == checked and other.durable:
            raise IllegalStateError(
                f"durable subscription {checked!r} has an active consumer on this "
                "connection: close it before unsubscribing"
            )
    return checked


class RedeliveryLimit:
    """When a consumer stops handing a message out and rejects it (poison messages).

    A message is rejected once it has failed more than ``max_redeliveries`` times, so the
    application sees it at most ``max_redeliveries + 1`` times. Failures are what the
    broker counts (the delivery count it sends) or, if more, what this consumer counted
    itself: a failure whose give-back was lost with the connection, or that a backup never
    heard of, still counts. The consumer's own counts are kept for the last ``remember``
    message ids."""

    def __init__(self, max_redeliveries: int, *, remember: int = 10_000) -> None:
        if isinstance(max_redeliveries, bool) or not isinstance(max_redeliveries, int):
            raise ConfigurationError(
                f"max_redeliveries must be a whole number >= -1, not {max_redeliveries!r}"
            )
        if max_redeliveries < -1:
            raise ConfigurationError(
                f"max_redeliveries must be -1 (no limit) or more, not {max_redeliveries}"
            )
        self.max_redeliveries = max_redeliveries
        self._remember = remember
        self._failed: OrderedDict[str, int] = OrderedDict()

    @property
    def limited(self) -> bool:
        return self.max_redeliveries >= 0

    def failures(self, message_id: str | None, delivery_count: int) -> int:
        counted = self._failed.get(message_id, 0) if message_id is not None else 0
        return max(delivery_count, counted)

    def exceeded(self, message_id: str | None, delivery_count: int) -> bool:
        """Whether this delivery must be rejected instead of handed out."""
        return self.limited and self.failures(message_id, delivery_count) > self.max_redeliveries

    def failed(self, message_id: str | None, delivery_count: int) -> None:
        """The application failed on this delivery: one failure more."""
        if message_id is None or not self.limited:
            return
        self._failed[message_id] = self.failures(message_id, delivery_count) + 1
        self._failed.move_to_end(message_id)
        if len(self._failed) > self._remember:
            self._failed.popitem(last=False)
