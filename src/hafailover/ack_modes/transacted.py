"""SESSION_TRANSACTED (F9): receives join the transaction; commit acknowledges them.

The transaction's own rules live in hafailover.tx; this adapts them to the
acknowledge-rule interface so a session treats every mode alike.
"""

from __future__ import annotations

from typing import ClassVar

from hafailover.ack_modes.base import AckRules, Delivery, FailoverOutcome
from hafailover.ack_modes.modes import AckMode
from hafailover.tx import TransactionState

__all__ = ["TransactedAckRules"]


class TransactedAckRules(AckRules):
    mode: ClassVar[AckMode] = AckMode.SESSION_TRANSACTED

    transaction: TransactionState

    def __init__(self, session_id: int) -> None:
        super().__init__(session_id)
        self.transaction = TransactionState()
        self._received: list[str] = []

    def delivered(self, tag: str) -> Delivery:
        self.transaction.work()
        self._received.append(tag)
        return super().delivered(tag)

    def unfinished(self) -> str | None:
        if self.transaction.dirty:
            return f"session {self.session_id} has a transaction with work in it"
        return None

    def received_in_transaction(self) -> tuple[str, ...]:
        """Tags to acknowledge inside the transaction at commit."""
        return tuple(self._received)

    def transaction_ended(self) -> None:
        """Commit or rollback finished: the next transaction starts empty."""
        self._received.clear()

    def failover(
        self,
        *,
        reattached: bool,
        lost_acks: tuple[tuple[str, str, str], ...] = (),
        lost_work: bool = False,
        commit_received: bool | None = None,
    ) -> FailoverOutcome:
        doomed = self.transaction.failover(
            reattached=reattached, lost_work=lost_work, commit_received=commit_received
        )
        if reattached and not doomed:
            return FailoverOutcome(stale=(), dirty=False, discard_prefetched=False)
        if not reattached:
            self.generation += 1
        stale = tuple(self._received)
        self._received.clear()
        return FailoverOutcome(
            stale=stale,
            dirty=doomed,
            discard_prefetched=not reattached,
            rolled_back=doomed,  # only a transaction with work in it is ever doomed
        )
