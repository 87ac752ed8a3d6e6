"""AUTO_ACKNOWLEDGE (F6), DUPS_OK_ACKNOWLEDGE (F7) and no-ack sessions.

AUTO: each message is acknowledged as receive() returns or the listener
finishes; a message whose listener raised is not acknowledged but given back for
redelivery (JMS), in DUPS_OK too. Only the last delivered message can be caught by a failover; its
acknowledgement cannot be sent to the new session, so it is reported: receive()
raises AcknowledgeFailed (the broker will redeliver the message) and for a
listener the exception listener is told. DUPS_OK: the same, but silently,
since the application accepted duplicates. No-ack: the broker settled each
message as it sent it; there is never anything to acknowledge.

AUTO acknowledges are pipelined where F6 allows it: the next message may be handed out
before the previous one's acknowledge is confirmed when a redelivery of the previous one
can be told by the id its sender gave it. A reattach replays unconfirmed acknowledges
from the confirmation window; a reconnect loses them, and then a redelivery of any of
those messages but the last is acknowledged and dropped (``expect_again``), so the
application still sees at most the last one again. A message without its sender's id is
confirmed before the next one is handed out, as is every one with ``block_on_acknowledge``.
At most ``PIPELINED_ACKS`` acknowledges of a session wait for confirmation at once.
"""

from __future__ import annotations

from typing import ClassVar, Final

import attrs

from hafailover.ack_modes.base import (
    AckAction,
    AckDecision,
    AckRules,
    ConfirmFirst,
    Delivery,
    FailoverOutcome,
)
from hafailover.ack_modes.modes import AckMode
from hafailover.errors import ErrorCode

__all__ = ["PIPELINED_ACKS", "AutoAckRules", "DupsOkAckRules", "NoAckRules"]

# At most this many AUTO acknowledges of one session wait for confirmation at once.
PIPELINED_ACKS: Final = 256
# Ids of redeliveries still expected, kept over several reconnects, at most this many.
_EXPECTED_AT_MOST: Final = 4 * PIPELINED_ACKS


class AutoAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.AUTO
    confirms_acknowledges: ClassVar[bool] = True

    def __init__(self, session_id: int) -> None:
        super().__init__(session_id)
        self._last_tag: str | None = None  # the delivery handed out last
        # The delivery handed out whose automatic acknowledge has not been decided yet
        # (a listener still running on it, or a receive about to return it).
        self._in_hand: str | None = None
        # Redeliveries to drop, by (subscription, sender's id), oldest first. Kept when one
        # comes (the acknowledge that drops it may be lost to a later reconnect too).
        self._expected: dict[tuple[str, str], None] = {}

    def delivered(self, tag: str) -> Delivery:
        self._last_tag = self._in_hand = tag
        return super().delivered(tag)

    def unfinished(self) -> str | None:
        if self._in_hand is not None:
            return f"session {self.session_id} has a message whose acknowledge is still to come"
        return None

    def _decided(self, delivery: Delivery) -> None:
        if delivery.tag == self._in_hand:
            self._in_hand = None

    @staticmethod
    def pipelines(*, sender_id: bool, block_on_acknowledge: bool) -> bool:
        """F6: whether the next message may be handed out before this one's acknowledge
        is confirmed: only when a redelivery of this one can be told by its sender's id
        (``sender_id``) and dropped, and the application did not ask to block."""
        return sender_id and not block_on_acknowledge

    @staticmethod
    def confirm_first(*, last_pipelined: bool, last_done: bool, in_flight: int) -> ConfirmFirst:
        """F6: which acknowledge must be confirmed (or its failure reported) before the next
        message is handed out: the last message's unless it is pipelined and still in
        flight; else the oldest in flight once PIPELINED_ACKS wait."""
        if in_flight >= PIPELINED_ACKS:
            return ConfirmFirst.OLDEST
        if not last_pipelined or last_done:
            return ConfirmFirst.LAST
        return ConfirmFirst.NONE

    @staticmethod
    def ack_failed(code: ErrorCode | None, *, last: bool) -> AckDecision:
        """An acknowledge ended with an error (``code``): what the application hears.
        The last message's, cut by a failover or unanswered, may come again: receive
        raises (F6). An earlier, pipelined one cut by a failover is the failover's: a
        reattach replayed it, a reconnect made its redelivery one to drop. Any other
        failure of an earlier one means that message may come again: reported too."""
        cut = code in (ErrorCode.UNBLOCKED, ErrorCode.NOT_CONNECTED)
        if last and (cut or code is ErrorCode.CONNECTION_TIMEDOUT):
            return AckDecision(AckAction.RAISE, code=ErrorCode.ACKNOWLEDGE_FAILED)
        if last:
            return AckDecision(AckAction.RAISE, code=code)  # the broker's own refusal
        if cut:
            return AckDecision(AckAction.NOTHING)
        return AckDecision(AckAction.RAISE, code=ErrorCode.ACKNOWLEDGE_FAILED)

    def failover(
        self,
        *,
        reattached: bool,
        lost_acks: tuple[tuple[str, str, str], ...] = (),
        lost_work: bool = False,
        commit_received: bool | None = None,
    ) -> FailoverOutcome:
        outcome = super().failover(reattached=reattached)
        if reattached:
            return outcome  # unconfirmed acknowledges are replayed from the window
        # F6: the last message handed out may come again (its receive raises); the ones
        # before it, whose acknowledges were pipelined, must not.
        again = [
            (subscription, message_id)
            for subscription, tag, message_id in lost_acks
            if message_id and tag != self._last_tag
        ]
        expected = self._expected
        for key in again:
            expected[key] = None
        while len(expected) > _EXPECTED_AT_MOST:
            del expected[next(iter(expected))]
        return attrs.evolve(outcome, expect_again=frozenset(again))

    def redelivery_expected(self, subscription: str, message_id: str | None) -> bool:
        return message_id is not None and (subscription, message_id) in self._expected

    def after_delivery(self, delivery: Delivery) -> AckDecision:
        self._decided(delivery)
        if self.is_stale(delivery):
            return self._stale()
        return AckDecision(AckAction.SEND, (delivery.tag,))

    def listener_failed(self, delivery: Delivery) -> AckDecision:
        # Not acknowledged, given back: the broker delivers it again (with its delivery
        # count raised), as JMS has it for a listener that throws. A delivery of a session
        # a reconnect replaced needs nothing: the broker delivers it again anyway.
        self._decided(delivery)
        if self.is_stale(delivery):
            return AckDecision(AckAction.NOTHING)
        return AckDecision(AckAction.REDELIVER, (delivery.tag,))

    def acknowledge_not_sent(self) -> AckDecision:
        # The broker will deliver the message again: AUTO says so, DUPS_OK stays silent.
        return self._stale()

    def _stale(self) -> AckDecision:
        return AckDecision(AckAction.RAISE, code=ErrorCode.ACKNOWLEDGE_FAILED)


class DupsOkAckRules(AutoAckRules):
    """DUPS_OK acknowledges are never confirmed, so none is ever lost in flight."""

    mode: ClassVar[AckMode] = AckMode.DUPS_OK
    confirms_acknowledges: ClassVar[bool] = False

    def _stale(self) -> AckDecision:
        return AckDecision(AckAction.DROP)


class NoAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.NO_ACKNOWLEDGE
    acknowledges_deliveries: ClassVar[bool] = False
