"""Acknowledge modes and link reliability, and the check that they agree (F14)."""

from __future__ import annotations

import enum

from hafailover.errors import ConfigurationError

__all__ = ["AckMode", "LinkReliability", "check_link_reliability"]


class AckMode(enum.Enum):
    """JMS acknowledge modes, plus the two non-JMS ones brokers commonly offer."""

    AUTO = "auto"
    DUPS_OK = "dups-ok"
    CLIENT = "client"
    CLIENT_INDIVIDUAL = "client-individual"
    SESSION_TRANSACTED = "transacted"
    # Settled by the broker as it sends (STOMP ack:auto, AMQP pre-settled): no acks at all.
    NO_ACKNOWLEDGE = "no-ack"


class LinkReliability(enum.Enum):
    """Qpid link reliability: what the consumer's link promises."""

    UNRELIABLE = "unreliable"  # at most once
    AT_MOST_ONCE = "at-most-once"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"


_ACKED_MODES = frozenset(
    {
        AckMode.AUTO,
        AckMode.DUPS_OK,
        AckMode.CLIENT,
        AckMode.CLIENT_INDIVIDUAL,
        AckMode.SESSION_TRANSACTED,
    }
)
_UNACKED_LINKS = frozenset({LinkReliability.UNRELIABLE, LinkReliability.AT_MOST_ONCE})


def check_link_reliability(mode: AckMode, reliability: LinkReliability | None) -> None:
    """Reject a link reliability that contradicts the session's acknowledge mode (F14).

    A link that promises at-least-once needs acknowledgements, which a no-ack
    session never sends; a link that promises at most once cannot honour a
    session whose application acknowledges (or commits) what it processed.
    """
    if reliability is None:
        return
    if mode is AckMode.NO_ACKNOWLEDGE and reliability not in _UNACKED_LINKS:
        raise ConfigurationError(
            f"link reliability {reliability.value} contradicts acknowledge mode {mode.value}: "
            "a no-ack session never acknowledges (use unreliable or at-most-once)"
        )
    if mode in _ACKED_MODES and reliability in _UNACKED_LINKS:
        raise ConfigurationError(
            f"link reliability {reliability.value} contradicts acknowledge mode {mode.value}: "
            "the session acknowledges, so the link must be at-least-once or exactly-once"
        )
