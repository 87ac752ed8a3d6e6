"""Transaction state that mutation testing found unguarded (docs/testing.md)."""

from __future__ import annotations

import pytest

from hafailover.errors import CallTimeoutError, DisconnectedError, ErrorCode, IllegalStateError
from hafailover.tx import CommitAction, CommitDecision, TransactionState


def test_work_is_counted_from_zero_and_a_commit_starts_again() -> None:
    tx = TransactionState()
    assert tx.work_count == 0
    tx.work()
    tx.work()
    assert tx.work_count == 2
    tx.begin_commit()
    tx.commit_finished()
    assert tx.work_count == 0


def test_f3_no_commit_fate_without_a_failover() -> None:
    tx = TransactionState()
    assert tx.commit_fate() is None
    tx.work()
    tx.begin_commit()
    tx.commit_written()
    tx.commit_finished()
    assert tx.commit_fate() is None


@pytest.mark.parametrize("reattached", [True, False])
def test_f9_a_failover_before_the_commit_was_written_rolls_it_back(reattached: bool) -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    assert tx.failover(reattached=reattached, lost_work=False)
    fate = tx.commit_fate()
    assert fate is not None and fate.action is CommitAction.ROLL_BACK_AND_RAISE


def test_misuse_while_committing_says_what_to_do() -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    with pytest.raises(IllegalStateError, match=r"^the session is committing; wait for commit"):
        tx.work()
    with pytest.raises(IllegalStateError, match=r"^commit\(\) is already running on this session$"):
        tx.begin_commit()
    with pytest.raises(
        IllegalStateError, match=r"^commit\(\) is running on this session; rollback"
    ):
        tx.rollback()


ROLLED_BACK = CommitDecision(CommitAction.ROLL_BACK_AND_RAISE, ErrorCode.TRANSACTION_ROLLED_BACK)
UNKNOWN = CommitDecision(CommitAction.RAISE, ErrorCode.TRANSACTION_OUTCOME_UNKNOWN)


@pytest.mark.parametrize(
    ("decision", "cause", "text"),
    [
        (ROLLED_BACK, None, "the commit lost its connection before it reached the broker;"),
        (ROLLED_BACK, CallTimeoutError("t"), "the commit timed out before it reached the broker;"),
        (UNKNOWN, None, "the commit was sent but its connection was lost before the broker"),
        (UNKNOWN, CallTimeoutError("t"), "the commit was sent but timed out before the broker"),
    ],
)
def test_f3_the_interrupted_commit_says_why(
    decision: CommitDecision, cause: BaseException | None, text: str
) -> None:
    assert str(decision.interrupted_error(cause)).startswith(text)


# --- the CommitDecisions of the reworked commit path (each kills a mutant of its line) ---


def test_a_cut_decision_passes_its_cause_on() -> None:
    error = CommitDecision(CommitAction.RAISE, ErrorCode.TRANSACTION_OUTCOME_UNKNOWN).error(
        DisconnectedError("gone")
    )
    assert isinstance(error, DisconnectedError)


def test_the_rollback_only_decision_in_full() -> None:
    tx = TransactionState()
    tx.begun_on_broker()
    tx.work()
    tx.failover(reattached=True, lost_work=True)
    decision = tx.begin_commit()
    assert decision.action is CommitAction.ROLL_BACK_AND_RAISE
    assert decision.give_back is True
    assert str(decision.error()) == (
        "the transaction was rolled back: a failover made it rollback-only; "
        "replay its work and commit again"
    )


def test_a_cut_before_the_write_is_a_rollback_to_carry_out() -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    assert tx.commit_cut().action is CommitAction.ROLL_BACK_AND_RAISE


def test_a_refused_commit_only_raises() -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    assert tx.commit_refused("no").action is CommitAction.RAISE


def test_a_refused_transfer_in_full() -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    fate = tx.transfer_refused("full")
    assert fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
    assert fate.give_back is True
    assert tx.commit_fate() is None


def test_a_commit_whose_outcome_is_unknown_is_doomed_by_the_failover() -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    tx.commit_written()
    assert tx.failover(reattached=False, lost_work=False) is True


@pytest.mark.parametrize("reattached", [False, True])
def test_a_commit_caught_unwritten_gives_back_only_on_a_kept_session(reattached: bool) -> None:
    tx = TransactionState()
    tx.work()
    tx.begin_commit()
    tx.failover(reattached=reattached, lost_work=False)
    fate = tx.commit_fate()
    assert fate is not None and fate.give_back is reattached
