"""CLIENT_ACKNOWLEDGE and CLIENT_INDIVIDUAL_ACKNOWLEDGE (F8).

The application acknowledges; in CLIENT mode one acknowledge() covers every
message the session delivered so far, in CLIENT_INDIVIDUAL only the one.

A session holding unacknowledged messages at a reconnect is *dirty*: those
messages and everything prefetched are stale (the new broker session will
redeliver them). The next acknowledge() then recovers the session implicitly
and raises StaleAcknowledge; the recover is a full one (the broker redelivers)
only if messages were delivered since the failover, else it merely marks the
session clean. recover() after a failover always succeeds and cleans the session.
CLIENT_INDIVIDUAL also gives one message back alone (``release``), under the same rules.
"""

from __future__ import annotations

from typing import ClassVar

from hafailover.ack_modes.base import (
    AckAction,
    AckDecision,
    AckRules,
    Delivery,
    FailoverOutcome,
    RecoverDecision,
)
from hafailover.ack_modes.modes import AckMode
from hafailover.errors import ErrorCode, IllegalStateError

__all__ = ["ClientAckRules", "ClientIndividualAckRules"]

_TAKEN_BACK_KEPT = 10_000


class ClientAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.CLIENT
    acknowledged_by_application: ClassVar[bool] = True

    def __init__(self, session_id: int) -> None:
        super().__init__(session_id)
        # Tags delivered to the application and not yet acknowledged, in order.
        self._unacked: dict[str, None] = {}
        # Delivered, unacknowledged, and their consumer closed: the broker took them back.
        # The newest _TAKEN_BACK_KEPT only: an older one's acknowledge does nothing.
        self._taken_back: dict[str, None] = {}
        self.dirty = False

    @property
    def unacknowledged(self) -> tuple[str, ...]:
        return tuple(self._unacked)

    def unfinished(self) -> str | None:
        if self._unacked:
            return f"session {self.session_id} holds {len(self._unacked)} unacknowledged message(s)"
        return None

    def delivered(self, tag: str) -> Delivery:
        self._unacked[tag] = None
        return super().delivered(tag)

    def acknowledge_all(self) -> AckDecision:
        """Session.acknowledge(): every message delivered so far, as acknowledging the
        last one does; a dirty session raises even with nothing delivered since (F8)."""
        if self.dirty:
            return self._recover_implicitly()
        if self._unacked:
            return self._acknowledge(next(reversed(self._unacked)))
        return AckDecision(AckAction.NOTHING)

    def acknowledge(self, delivery: Delivery) -> AckDecision:
        self.check_owner(delivery)
        if self.dirty:
            return self._recover_implicitly()
        if self.is_stale(delivery):
            # A clean session had nothing unacknowledged at the failover: this
            # message was acknowledged before it, so there is nothing to do.
            return AckDecision(AckAction.NOTHING)
        if delivery.tag in self._taken_back:
            return self._acknowledge_taken_back(delivery.tag)
        return self._acknowledge(delivery.tag)

    def subscription_ended(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            if tag in self._unacked:
                del self._unacked[tag]
                self._taken_back[tag] = None
        while len(self._taken_back) > _TAKEN_BACK_KEPT:
            del self._taken_back[next(iter(self._taken_back))]

    def _acknowledge_taken_back(self, tag: str) -> AckDecision:
        """The message's consumer closed before it was acknowledged. A CLIENT acknowledge
        covers the whole session: what the session still holds is acknowledged (the
        closed consumer's messages are not, the broker has them back)."""
        self._taken_back.pop(tag, None)
        return self.acknowledge_all()

    def _recover_implicitly(self) -> AckDecision:
        """F8: the acknowledge of a dirty session recovers it (what was delivered since the
        failover goes back to the broker too), then tells the application it failed."""
        held = tuple(self._unacked)
        self._unacked.clear()
        self.dirty = False
        return AckDecision(
            AckAction.RAISE, code=ErrorCode.ACKNOWLEDGE_STALE, recover=bool(held), redeliver=held
        )

    def _acknowledge(self, tag: str) -> AckDecision:
        if tag not in self._unacked:
            return AckDecision(AckAction.NOTHING)
        tags = tuple(self._unacked)
        self._unacked.clear()
        return AckDecision(AckAction.SEND, tags)

    def recover(self) -> RecoverDecision:
        tags = tuple(self._unacked)
        self._unacked.clear()
        self._taken_back.clear()
        self.dirty = False
        return RecoverDecision(tags)

    def _reconnected(self) -> FailoverOutcome:
        stale = tuple(self._unacked)
        self._unacked.clear()
        self._taken_back.clear()  # stale now: the acknowledge of one does nothing
        # Dirtiness sticks until an acknowledge or recover deals with it, even
        # across a second failover.
        self.dirty = self.dirty or bool(stale)
        return FailoverOutcome(stale=stale, dirty=self.dirty)


class ClientIndividualAckRules(ClientAckRules):
    """CLIENT_INDIVIDUAL: each message is settled alone, so one can also be given back
    alone (``release``: STOMP NACK, AMQP modified with delivery-failed). A release is an
    acknowledge with another outcome, and a failover treats it as one: a release in a
    session dirty since a reconnect recovers it and raises StaleAcknowledge (F8: the
    message went back with the old broker session already)."""

    mode: ClassVar[AckMode] = AckMode.CLIENT_INDIVIDUAL

    def release(self, delivery: Delivery) -> AckDecision:
        self.check_owner(delivery)
        if self.dirty:
            return self._recover_implicitly()
        if self.is_stale(delivery) or delivery.tag not in self._unacked:
            # Acknowledged or released already (a clean session held nothing unsettled at
            # the failover): as a second acknowledge, nothing to do.
            return AckDecision(AckAction.NOTHING)
        del self._unacked[delivery.tag]
        return AckDecision(AckAction.REDELIVER, (delivery.tag,))

    def _acknowledge(self, tag: str) -> AckDecision:
        if tag not in self._unacked:
            return AckDecision(AckAction.NOTHING)
        del self._unacked[tag]
        return AckDecision(AckAction.SEND, (tag,))

    def _acknowledge_taken_back(self, tag: str) -> AckDecision:
        """Acknowledging one message alone says it was processed: tell the application
        that it was not settled, and will come again, instead of pretending."""
        self._taken_back.pop(tag, None)
        raise IllegalStateError(
            "this message's consumer closed before the message was acknowledged: the broker "
            "took it back and delivers it again (acknowledge before closing the consumer)"
        )

    def acknowledge_all(self) -> AckDecision:
        """Session.acknowledge() covers every message delivered, each acknowledged alone."""
        decision = super().acknowledge_all()
        if decision.action is AckAction.SEND:
            decision = AckDecision(AckAction.SEND, (*self._unacked, *decision.tags))
            self._unacked.clear()
        return decision
