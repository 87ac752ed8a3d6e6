"""Transaction state of a transacted session: clean, dirty, rollback-only, in doubt (F9, F3)."""

from hafailover.tx.state import (
    CommitAction,
    CommitDecision,
    RollbackDecision,
    TransactionState,
    TxPhase,
)

__all__ = ["CommitAction", "CommitDecision", "RollbackDecision", "TransactionState", "TxPhase"]
