"""What every acknowledge-mode rule set shares: delivery tokens, decisions, the interface.

A session hands each message to the application with a ``Delivery`` token that
records the session and the session *generation*: the generation goes up at
every failover that recreates the session (a reconnect), so a token from an
earlier generation names a delivery the new broker session has never heard
of. Acknowledging it cannot work; what happens instead is the ack mode's rule.

A reattach keeps the broker's session, so it changes nothing here: acks in the
confirmation window are replayed like any other command.

The driver asks a rule set what it can do, never what class it is: whether its
acknowledges are confirmed (``confirms_acknowledges``), whether the application
acknowledges (``acknowledged_by_application``), whether it has a transaction
(``transaction``), whether a buffered delivery is stale (``prefetched_stale``).

Pure: no I/O, threads or clocks.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from hafailover.ack_modes.modes import AckMode
from hafailover.errors import ErrorCode, IllegalStateError
from hafailover.tx import TransactionState

__all__ = [
    "AckAction",
    "AckDecision",
    "AckRules",
    "ConfirmFirst",
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


class ConfirmFirst(enum.Enum):
    """Which AUTO acknowledge must be confirmed before the next message is handed out."""

    NONE = "none"
    LAST = "the last message's"
    OLDEST = "the oldest in flight"


@attrs.frozen
class AckDecision:
    action: AckAction
    tags: tuple[str, ...] = ()
    code: ErrorCode | None = None
    # Ask the broker to redeliver what this session holds unacknowledged: ``redeliver``.
    recover: bool = False
    redeliver: tuple[str, ...] = ()


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
    rolled_back: bool = False  # TRANSACTED: a transaction with work in it was doomed (F9)


# What gives a message back in the modes that have no release() of one message.
_RELEASE_INSTEAD: dict[AckMode, str] = {
    AckMode.AUTO: "receive() acknowledged the message already; a message listener that "
    "raises gives its message back",
    AckMode.DUPS_OK: "receive() acknowledged the message already; a message listener that "
    "raises gives its message back",
    AckMode.CLIENT: "a CLIENT session settles every earlier message with the one named "
    "(a STOMP NACK is cumulative there too); use recover(), or a CLIENT_INDIVIDUAL session",
    AckMode.CLIENT_INDIVIDUAL: "",
    AckMode.SESSION_TRANSACTED: "rollback() gives the transaction's messages back",
    AckMode.NO_ACKNOWLEDGE: "the broker settled the message as it sent it",
}


class AckRules:
    """The acknowledge rules of one session. Subclasses implement one mode each."""

    mode: ClassVar[AckMode]
    # Capabilities, which the driver asks instead of the class:
    # each acknowledge is confirmed by the broker before it counts (AUTO, F6)
    confirms_acknowledges: ClassVar[bool] = False
    # the application acknowledges with acknowledge() (CLIENT modes, F8)
    acknowledged_by_application: ClassVar[bool] = False
    # deliveries are acknowledged at all (every mode but NO_ACKNOWLEDGE, which the broker
    # settles as it sends)
    acknowledges_deliveries: ClassVar[bool] = True
    # the session's transaction (SESSION_TRANSACTED, F9); None elsewhere
    transaction: TransactionState | None = None

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

    def prefetched_stale(self, generation: int) -> bool:
        """A delivery buffered in ``generation`` and not handed out yet: stale when a
        reconnect came since (the new broker session sends it again)."""
        return generation != self.generation

    def acknowledge_all(self) -> AckDecision:
        """acknowledge() on the session: what it covers (CLIENT modes only)."""
        raise IllegalStateError(
            f"acknowledge() is for CLIENT and CLIENT_INDIVIDUAL sessions, not {self.mode.value}"
        )

    def received_in_transaction(self) -> tuple[str, ...]:
        """Deliveries to acknowledge inside the transaction at commit (TRANSACTED)."""
        return ()

    def unfinished(self) -> str | None:
        """What a move to another broker would cut in this session now (a transaction with
        work in it, messages the application has not acknowledged), or None: a priority
        failback waits for a session with nothing unfinished."""
        return None

    def transaction_ended(self) -> None:
        """Commit or rollback finished: the next transaction starts empty (TRANSACTED)."""

    def subscription_ended(self, tags: tuple[str, ...]) -> None:
        """A consumer closed holding ``tags`` delivered and not acknowledged: the broker
        took them back with the subscription and delivers them again (CLIENT modes)."""

    @staticmethod
    def ack_failed(code: ErrorCode | None, *, last: bool) -> AckDecision:
        """An acknowledge the broker was asked to confirm ended with an error: what the
        application hears (only modes that confirm acknowledges have any)."""
        return AckDecision(AckAction.NOTHING)

    @staticmethod
    def confirm_first(*, last_pipelined: bool, last_done: bool, in_flight: int) -> ConfirmFirst:
        """Which confirmed acknowledge must be confirmed before the next message is handed
        out (only modes that confirm acknowledges wait for any)."""
        return ConfirmFirst.NONE

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

    def release(self, delivery: Delivery) -> AckDecision:
        """The application gave one message back (``Message.release()``): a failed
        delivery, which the broker counts and delivers again. Only CLIENT_INDIVIDUAL
        settles one message alone; elsewhere it is misuse, said with what to use instead."""
        self.check_owner(delivery)
        raise IllegalStateError(
            f"release() is for CLIENT_INDIVIDUAL sessions, not {self.mode.value}: "
            f"{_RELEASE_INSTEAD[self.mode]}"
        )

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
        self,
        *,
        reattached: bool,
        lost_acks: tuple[tuple[str, str, str], ...] = (),
        lost_work: bool = False,
        commit_received: bool | None = None,
    ) -> FailoverOutcome:
        """The connection failed over; ``reattached`` when the broker kept the session.
        ``lost_work`` and ``commit_received`` are the transaction's (F9, F3).
        ``lost_acks``: acknowledges a reconnect lost, in order, as (subscription, delivery
        tag, the message's id when its sender gave it and the acknowledge was pipelined,
        else "")."""
        if reattached:
            return FailoverOutcome(stale=(), dirty=False, discard_prefetched=False)
        self.generation += 1
        return self._reconnected()

    def _reconnected(self) -> FailoverOutcome:
        return FailoverOutcome(stale=(), dirty=False)
