"""What every acknowledge-mode rule set shares: delivery tokens, decisions, the interface.

A session hands each message to the application with a ``Delivery`` token that
records the session and the session *generation*: the generation goes up at
every failover that recreates the session (a reconnect), so a token from an
earlier generation names a delivery the new broker session has never heard
of. Acknowledging it cannot work; what happens instead is the ack mode's rule.

A reattach keeps the broker's session, so it changes nothing here: acks in the
confirmation window are replayed like any other command.

Pure: no I/O, threads or clocks.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from hafailover.ack_modes.modes import AckMode
from hafailover.errors import ErrorCode, IllegalStateError

__all__ = [
    "AckAction",
    "AckDecision",
    "AckRules",
    "Delivery",
    "FailoverOutcome",
    "RecoverDecision",
]


@attrs.frozen
class Delivery:
    """A message as handed to the application: what acknowledging it needs."""

    session_id: int
    generation: int
    tag: str  # the broker's delivery tag or message id for this delivery


class AckAction(enum.Enum):
    SEND = "send"  # acknowledge ``tags`` on the broker
    NOTHING = "nothing"  # nothing to send (already acknowledged, or not this mode's job)
    DROP = "drop"  # stale and silently dropped (the mode allows duplicates)
    RAISE = "raise"  # report ``code``; with ``recover`` the session recovers first
    REDELIVER = "redeliver"  # give ``tags`` back: the broker delivers them again


@attrs.frozen
class AckDecision:
    action: AckAction
    tags: tuple[str, ...] = ()
    code: ErrorCode | None = None
    # Ask the broker to redeliver what this session holds unacknowledged.
    recover: bool = False


@attrs.frozen
class RecoverDecision:
    redeliver: tuple[str, ...]  # tags to give back to the broker (NACK / release)


@attrs.frozen
class FailoverOutcome:
    """What a reconnect did to this session's deliveries."""

    stale: tuple[str, ...]  # delivered, unacknowledged, now unacknowledgeable
    dirty: bool  # the session held unacknowledged messages (CLIENT) or work (TRANSACTED)
    discard_prefetched: bool = True  # prefetched messages are dropped: the broker resends
    # AUTO (F6): (subscription, sender's id) of messages handed out before the last one
    # whose acknowledges the reconnect lost: a redelivery of one is acknowledged and
    # dropped, not delivered again.
    expect_again: frozenset[tuple[str, str]] = frozenset()


class AckRules:
    """The acknowledge rules of one session. Subclasses implement one mode each."""

    mode: ClassVar[AckMode]

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.generation = 0

    def delivered(self, tag: str) -> Delivery:
        """A message is being handed to the application."""
        return Delivery(self.session_id, self.generation, tag)

    def check_owner(self, delivery: Delivery) -> None:
        if delivery.session_id != self.session_id:
            raise IllegalStateError(
                f"the message belongs to session {delivery.session_id}, "
                f"not to session {self.session_id}"
            )

    def is_stale(self, delivery: Delivery) -> bool:
        return delivery.generation != self.generation

    def after_delivery(self, delivery: Delivery) -> AckDecision:
        """receive() returned or a listener finished: the automatic acknowledge, if any."""
        return AckDecision(AckAction.NOTHING)

    def listener_failed(self, delivery: Delivery) -> AckDecision:
        """A message listener raised on this delivery. The message was not delivered
        successfully; in the modes that acknowledge automatically it goes back to the
        broker for redelivery (JMS). Elsewhere the application acknowledges, commits or
        recovers as it would have: nothing happens here."""
        return AckDecision(AckAction.NOTHING)

    def acknowledge_not_sent(self) -> AckDecision:
        """The automatic acknowledge could not be written (the connection was lost or is
        failing over): what the application hears (F6, F7)."""
        return AckDecision(AckAction.NOTHING)

    def acknowledge(self, delivery: Delivery) -> AckDecision:
        """The application called acknowledge() on a message."""
        self.check_owner(delivery)
        return AckDecision(AckAction.NOTHING)

    def recover(self) -> RecoverDecision:
        """The application called recover(): always succeeds (F6, F8)."""
        return RecoverDecision(())

    @staticmethod
    def pipelines(*, sender_id: bool, block_on_acknowledge: bool) -> bool:
        """Whether the next message may be handed out before the automatic acknowledge of
        this one is confirmed (only AUTO confirms them)."""
        return False

    def redelivery_expected(self, subscription: str, message_id: str | None) -> bool:
        """A delivery after a reconnect: whether it is a message this session handed out
        already (and must drop, acknowledging it)."""
        return False

    def failover(
        self, *, reattached: bool, lost_acks: tuple[tuple[str, str, str], ...] = ()
    ) -> FailoverOutcome:
        """The connection failed over; ``reattached`` when the broker kept the session.
        ``lost_acks``: acknowledges a reconnect lost, in order, as (subscription, delivery
        tag, the message's id when its sender gave it and the acknowledge was pipelined,
        else "")."""
        if reattached:
            return FailoverOutcome(stale=(), dirty=False, discard_prefetched=False)
        self.generation += 1
        return self._reconnected()

    def _reconnected(self) -> FailoverOutcome:
        return FailoverOutcome(stale=(), dirty=False)
