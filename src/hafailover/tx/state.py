"""Transaction state of one transacted session (F9, F3).

Theory of operation
-------------------
A transacted session always has a current transaction. It is CLEAN until the
application sends or receives in it, then DIRTY. commit() moves it to
COMMITTING until the commit is written to the network, then COMMIT_SENT until
the broker answers.

A failover decides the fate of the transaction:

========================  ==================================  =========================
phase at failover         reattached, nothing lost            reconnected, or lost work
========================  ==================================  =========================
CLEAN                     CLEAN                               CLEAN
DIRTY                     DIRTY (100% transparent)            ROLLBACK_ONLY
ROLLBACK_ONLY             ROLLBACK_ONLY                       ROLLBACK_ONLY
COMMITTING (not written)  ROLLBACK_ONLY, commit -> rolled back ROLLBACK_ONLY, rolled back
COMMIT_SENT               commit received: outcome unknown    outcome unknown
                          commit not received: rolled back
========================  ==================================  =========================

A rollback-only transaction is never committed: commit() rolls it back and
raises TransactionRolledBack, so the application replays its work on the same
session (Artemis, Qpid). rollback() always succeeds and cleans the session.
Transacted sends are never replayed from the confirmation window: lost work
means rollback, not repair.

Whether the broker holds the transaction (so a rollback must be sent to it) is
decided here alone: it does from the moment the driver began it there
(``begun_on_broker``) until it ends or a reconnect replaces the session, whose
new session has no trace of it; then the rollback is local.

Every way commit() can end without the broker's yes is one decision here, a
``CommitDecision`` that says what commit() raises and whether the broker must be
told to roll back: rollback-only at the call (``begin_commit``), cut by a failover
or a lost connection or a timeout (``commit_cut``), refused by the broker
(``commit_refused``), a transacted send refused before the commit was written
(``transfer_refused``). The driver writes and waits; it decides none of these.

Pure: no I/O, threads or clocks. Misuse (commit while a commit is running)
raises IllegalStateError and leaves the state as it was.
"""

from __future__ import annotations

import enum

import attrs

from hafailover.errors import (
    CallTimeoutError,
    DisconnectedError,
    ErrorCode,
    HaFailoverError,
    IllegalStateError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
)

__all__ = ["CommitAction", "CommitDecision", "RollbackDecision", "TransactionState", "TxPhase"]


class TxPhase(enum.Enum):
    CLEAN = "clean"
    DIRTY = "dirty"
    COMMITTING = "committing"  # commit() called, not yet written to the network
    COMMIT_SENT = "commit sent"  # written, waiting for the broker's answer
    ROLLBACK_ONLY = "rollback-only"


class CommitAction(enum.Enum):
    SEND_COMMIT = "send commit"  # go ahead: write the commit and wait for the answer
    ROLL_BACK_AND_RAISE = "roll back and raise"  # rollback-only: roll back, raise
    RAISE = "raise"  # just raise: nothing left to undo (outcome unknown, or refused)


@attrs.frozen
class CommitDecision:
    action: CommitAction
    code: ErrorCode | None = None  # the error to raise, for the two raising actions
    rollback_on_broker: bool = False  # the broker still holds the transaction: roll it back
    # The deliveries received in the transaction are still this session's, on a link that
    # lives on: give them back, so the broker delivers them again now. (A refused commit
    # leaves them to the broker, which rolled the transaction back.)
    give_back: bool = False
    reason: str = ""  # why it was rolled back, when that is known at the decision

    def error(self, cause: BaseException | None = None) -> HaFailoverError:
        """What commit() raises with this decision (``cause``: why the wait ended)."""
        if self.reason:
            return TransactionRolledBackError(self.reason)
        return self.interrupted_error(cause)

    def interrupted_error(self, cause: BaseException | None) -> HaFailoverError:
        """What a commit whose wait ended without an answer raises (F3), given why it
        ended (``cause``): rolled back, outcome unknown, or, once the connection is lost for
        good, DisconnectedError (F2) saying which of the two."""
        rolled_back = self.code is ErrorCode.TRANSACTION_ROLLED_BACK
        timed_out = isinstance(cause, CallTimeoutError)
        if isinstance(cause, DisconnectedError):
            outcome = (
                "the transaction was rolled back"
                if rolled_back
                else "the commit was sent and may or may not have happened"
            )
            return DisconnectedError(f"{cause}; {outcome}")
        if rolled_back:
            why = "timed out" if timed_out else "lost its connection"
            return TransactionRolledBackError(
                f"the commit {why} before it reached the broker; the transaction was rolled back"
            )
        why = "timed out" if timed_out else "its connection was lost"
        return TransactionOutcomeUnknownError(
            f"the commit was sent but {why} before the broker answered; it may or may "
            "not have happened (retry with the same duplicate ids to be safe)"
        )


@attrs.frozen
class RollbackDecision:
    rollback_on_broker: bool  # send a rollback; false: the broker has no trace of it


class TransactionState:
    """The transaction of one transacted session, across failovers."""

    __slots__ = ("_broker_has_tx", "_commit_fate", "phase", "work_count")

    def __init__(self) -> None:
        self.phase = TxPhase.CLEAN
        self.work_count = 0  # sends and receives in the current transaction
        self._broker_has_tx = False
        # Set when a failover caught a commit: what the waiting commit() must do.
        self._commit_fate: CommitDecision | None = None

    @property
    def dirty(self) -> bool:
        return self.phase is not TxPhase.CLEAN

    @property
    def rollback_only(self) -> bool:
        return self.phase is TxPhase.ROLLBACK_ONLY

    def work(self) -> None:
        """A send or receive joined the transaction."""
        if self.phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
            raise IllegalStateError("the session is committing; wait for commit() to return")
        if self.phase is TxPhase.CLEAN:
            self.phase = TxPhase.DIRTY
        self.work_count += 1

    def begin_commit(self) -> CommitDecision:
        """commit() was called."""
        if self.phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
            raise IllegalStateError("commit() is already running on this session")
        self._commit_fate = None  # a fate belongs to the commit it caught, never a later one
        if self.phase is TxPhase.ROLLBACK_ONLY:
            return self._rolled_back(
                "the transaction was rolled back: a failover made it rollback-only; "
                "replay its work and commit again"
            )
        self.phase = TxPhase.COMMITTING
        return CommitDecision(CommitAction.SEND_COMMIT)

    def commit_written(self) -> None:
        """The commit left for the network; from now on its outcome may be unknown."""
        if self.phase is TxPhase.COMMITTING:
            self.phase = TxPhase.COMMIT_SENT

    def commit_finished(self) -> None:
        """The broker answered the commit (success or rolled back): a new transaction starts."""
        self._reset()
        self._commit_fate = None

    def commit_fate(self) -> CommitDecision | None:
        """After a failover caught a commit: what the waiting commit() must do, once."""
        fate, self._commit_fate = self._commit_fate, None
        return fate

    def commit_cut(self, *, timed_out: bool = False) -> CommitDecision:
        """The commit's wait ended without the broker's answer (its connection was lost,
        or the call timed out: ``timed_out``): what commit() raises, whether or not a
        failover was applied yet.

        A failover that caught the commit has decided already. Otherwise a commit not yet
        written is rolled back (on the broker too when only the call timed out: the
        connection lives on and the broker holds the transaction), and one written may
        have happened: its outcome is unknown. Either way this transaction is over."""
        fate = self.commit_fate()
        if fate is not None:
            return fate  # the failover reset the transaction
        if self.phase is TxPhase.COMMITTING:
            fate = CommitDecision(
                CommitAction.ROLL_BACK_AND_RAISE,
                ErrorCode.TRANSACTION_ROLLED_BACK,
                rollback_on_broker=timed_out and self._broker_has_tx,
                give_back=timed_out,
            )
        else:
            fate = CommitDecision(CommitAction.RAISE, ErrorCode.TRANSACTION_OUTCOME_UNKNOWN)
        if self.phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
            self._reset()
        return fate

    def commit_refused(self, refusal: str) -> CommitDecision:
        """The broker answered the commit with a refusal: it rolled the transaction back."""
        self._reset()
        self._commit_fate = None
        return CommitDecision(
            CommitAction.RAISE,
            ErrorCode.TRANSACTION_ROLLED_BACK,
            reason=f"the broker refused the commit: {refusal}",
        )

    def transfer_refused(self, refusal: str) -> CommitDecision:
        """A send of the transaction was refused before the commit was written: the commit
        is abandoned and the transaction rolled back, on the broker too if it holds it."""
        return self._rolled_back(
            f"the broker refused a send of the transaction, which was rolled back: {refusal}"
        )

    def _rolled_back(self, reason: str) -> CommitDecision:
        """The transaction ends rolled back before any commit was written: on the broker
        too if it holds it, its deliveries given back; commit() raises ``reason``."""
        on_broker = self._broker_has_tx
        self._reset()
        self._commit_fate = None
        return CommitDecision(
            CommitAction.ROLL_BACK_AND_RAISE,
            ErrorCode.TRANSACTION_ROLLED_BACK,
            rollback_on_broker=on_broker,
            give_back=True,
            reason=reason,
        )

    def begun_on_broker(self) -> None:
        """The driver began the transaction on the broker (a STOMP BEGIN, an AMQP declare):
        ending it without a commit means telling the broker."""
        self._broker_has_tx = True

    def rollback(self) -> RollbackDecision:
        """rollback() was called: always succeeds, and the session is clean after it."""
        if self.phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
            raise IllegalStateError("commit() is running on this session; rollback must wait")
        decision = RollbackDecision(rollback_on_broker=self._broker_has_tx)
        self._reset()
        return decision

    def failover(
        self, *, reattached: bool, lost_work: bool, commit_received: bool | None = None
    ) -> bool:
        """Apply a failover; return whether this transaction was doomed by it.

        ``reattached``: the server still held the session. ``lost_work``: some
        transacted command of this transaction never reached the server.
        ``commit_received``: after a reattach, whether the server got the commit.
        """
        phase = self.phase
        if phase is TxPhase.CLEAN:
            self._broker_has_tx = reattached and self._broker_has_tx
            return False
        if phase is TxPhase.COMMIT_SENT and not (reattached and commit_received is False):
            # The commit may have happened: only duplicate detection can make a retry safe.
            self._commit_fate = CommitDecision(
                CommitAction.RAISE, ErrorCode.TRANSACTION_OUTCOME_UNKNOWN
            )
            self._reset()
            return True
        if phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
            # The commit never reached a server: it is rolled back, on the broker too
            # when the reattached session still holds the transaction.
            self._commit_fate = CommitDecision(
                CommitAction.ROLL_BACK_AND_RAISE,
                ErrorCode.TRANSACTION_ROLLED_BACK,
                rollback_on_broker=reattached and self._broker_has_tx,
                give_back=reattached,
            )
            self._reset()
            return True
        if phase is TxPhase.DIRTY and reattached and not lost_work:
            return False
        self.phase = TxPhase.ROLLBACK_ONLY
        self._broker_has_tx = reattached and self._broker_has_tx
        return True

    def _reset(self) -> None:
        self.phase = TxPhase.CLEAN
        self.work_count = 0
        self._broker_has_tx = False
