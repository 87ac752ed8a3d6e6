"""The link for a policy's protocol: the driver's default ``LinkFactory``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hafailover.core.window import ConfirmationWindow
from hafailover.protocols.amqp.link import AmqpLink
from hafailover.protocols.base import Link, LinkEvents
from hafailover.protocols.stomp.link import StompLink
from hafailover.url import FailoverPolicy

__all__ = ["make_link"]


def make_link(
    events: LinkEvents,
    policy: FailoverPolicy,
    window: ConfirmationWindow[Any],
) -> Link:
    """A new, unopened link for the policy's protocol."""
    if policy.brokers[0].scheme.startswith("stomp"):
        return StompLink(events, policy, window)
    return AmqpLink(events, policy)


# For type checkers: both link classes satisfy the protocol.
_check_stomp: Callable[..., Link] = StompLink
_check_amqp: Callable[..., Link] = AmqpLink
