"""AUTO_ACKNOWLEDGE (F6), DUPS_OK_ACKNOWLEDGE (F7) and no-ack sessions.

AUTO: each message is acknowledged as receive() returns or the listener
finishes. Only the last delivered message can be caught by a failover; its
acknowledgement cannot be sent to the new session, so it is reported: receive()
raises AcknowledgeFailed (the broker will redeliver the message) and for a
listener the exception listener is told. DUPS_OK: the same, but silently,
since the application accepted duplicates. No-ack: the broker settled each
message as it sent it; there is never anything to acknowledge.
"""

from __future__ import annotations

from typing import ClassVar

from hafailover.ack_modes.base import AckAction, AckDecision, AckRules, Delivery
from hafailover.ack_modes.modes import AckMode
from hafailover.errors import ErrorCode

__all__ = ["AutoAckRules", "DupsOkAckRules", "NoAckRules"]


class AutoAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.AUTO

    def after_delivery(self, delivery: Delivery) -> AckDecision:
        if self.is_stale(delivery):
            return self._stale()
        return AckDecision(AckAction.SEND, (delivery.tag,))

    def acknowledge_not_sent(self) -> AckDecision:
        # The broker will deliver the message again: AUTO says so, DUPS_OK stays silent.
        return self._stale()

    def _stale(self) -> AckDecision:
        return AckDecision(AckAction.RAISE, code=ErrorCode.ACKNOWLEDGE_FAILED)


class DupsOkAckRules(AutoAckRules):
    mode: ClassVar[AckMode] = AckMode.DUPS_OK

    def _stale(self) -> AckDecision:
        return AckDecision(AckAction.DROP)


class NoAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.NO_ACKNOWLEDGE
