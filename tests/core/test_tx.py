"""Transaction state (F9, F3): dirty sessions, rollback-only, commits caught by failover."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.errors import (
    CallTimeoutError,
    DisconnectedError,
    ErrorCode,
    IllegalStateError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
)
from hafailover.tx import CommitAction, TransactionState, TxPhase
from hafailover.tx.state import CommitDecision


def dirty() -> TransactionState:
    """A transaction begun on the broker with work in it."""
    tx = TransactionState()
    tx.begun_on_broker()
    tx.work()
    return tx


def test_commit_of_a_healthy_transaction() -> None:
    tx = dirty()
    assert tx.begin_commit().action is CommitAction.SEND_COMMIT
    tx.commit_written()
    assert tx.phase is TxPhase.COMMIT_SENT
    tx.commit_finished()
    assert tx.phase is TxPhase.CLEAN and tx.work_count == 0


def test_f9_dirty_transaction_becomes_rollback_only_after_reconnect() -> None:
    tx = dirty()
    assert tx.failover(reattached=False, lost_work=False) is True
    assert tx.rollback_only
    decision = tx.begin_commit()
    assert decision.action is CommitAction.ROLL_BACK_AND_RAISE
    assert decision.code is ErrorCode.TRANSACTION_ROLLED_BACK
    # The new session has no trace of it: the rollback is local.
    assert decision.rollback_on_broker is False
    # The application replays on the same session.
    assert tx.phase is TxPhase.CLEAN
    tx.work()
    assert tx.begin_commit().action is CommitAction.SEND_COMMIT


def test_f9_rollback_after_failover_succeeds_and_cleans() -> None:
    tx = dirty()
    tx.failover(reattached=False, lost_work=False)
    assert tx.rollback().rollback_on_broker is False
    assert tx.phase is TxPhase.CLEAN


def test_reattach_without_lost_work_is_transparent() -> None:
    tx = dirty()
    assert tx.failover(reattached=True, lost_work=False) is False
    assert tx.phase is TxPhase.DIRTY
    assert tx.begin_commit().action is CommitAction.SEND_COMMIT


def test_reattach_with_lost_work_rolls_back_on_the_broker() -> None:
    tx = dirty()
    assert tx.failover(reattached=True, lost_work=True) is True
    decision = tx.begin_commit()
    assert decision.action is CommitAction.ROLL_BACK_AND_RAISE
    assert decision.rollback_on_broker is True


def test_the_broker_holds_a_transaction_only_once_it_was_begun_there() -> None:
    """Receives join a transaction the broker hears of only at commit: rolling back one
    that was never begun there is local (its deliveries are given back)."""
    tx = TransactionState()
    tx.work()
    assert tx.rollback().rollback_on_broker is False
    tx.begun_on_broker()  # begun before its first send, which then failed: still there
    assert tx.rollback().rollback_on_broker is True
    assert tx.rollback().rollback_on_broker is False  # ended: nothing left to roll back


def test_a_reconnect_leaves_the_new_session_without_the_transaction() -> None:
    tx = dirty()
    tx.failover(reattached=False, lost_work=False)
    assert tx.begin_commit().rollback_on_broker is False
    tx = dirty()
    tx.failover(reattached=True, lost_work=True)
    assert tx.begin_commit().rollback_on_broker is True


@pytest.mark.parametrize("begun", [False, True])
def test_f3_a_commit_that_timed_out_unwritten_is_rolled_back_on_the_living_link(
    begun: bool,
) -> None:
    tx = TransactionState()
    if begun:
        tx.begun_on_broker()
    tx.work()
    tx.begin_commit()
    fate = tx.commit_cut(timed_out=True)
    assert fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
    assert fate.rollback_on_broker is begun
    assert fate.give_back  # the link lives on: its deliveries go back now
    assert isinstance(fate.error(CallTimeoutError("slow")), TransactionRolledBackError)
    assert tx.phase is TxPhase.CLEAN


def test_f3_a_commit_that_timed_out_written_is_outcome_unknown_and_left_alone() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    fate = tx.commit_cut(timed_out=True)
    assert fate.code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN
    assert not fate.rollback_on_broker


def test_f9_a_commit_the_broker_refused_is_rolled_back_and_says_why() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    fate = tx.commit_refused("no such transaction")
    assert fate.code is ErrorCode.TRANSACTION_ROLLED_BACK and not fate.rollback_on_broker
    error = fate.error()
    assert isinstance(error, TransactionRolledBackError)
    assert "refused the commit: no such transaction" in str(error)
    assert tx.phase is TxPhase.CLEAN and tx.commit_fate() is None


def test_f9_a_refused_transfer_abandons_the_commit_and_rolls_back_on_the_broker() -> None:
    tx = dirty()
    tx.begin_commit()
    fate = tx.transfer_refused("queue full")
    assert fate.action is CommitAction.ROLL_BACK_AND_RAISE
    assert fate.rollback_on_broker is True
    assert "refused a send of the transaction" in str(fate.error())
    assert tx.phase is TxPhase.CLEAN
    assert tx.begin_commit().action is CommitAction.SEND_COMMIT  # the session goes on


def test_clean_transaction_is_untouched() -> None:
    tx = TransactionState()
    assert tx.failover(reattached=False, lost_work=False) is False
    assert tx.phase is TxPhase.CLEAN


def test_f3_commit_in_flight_on_reconnect_is_outcome_unknown() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    tx.failover(reattached=False, lost_work=False)
    fate = tx.commit_fate()
    assert fate is not None
    assert fate.action is CommitAction.RAISE
    assert fate.code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN
    assert tx.commit_fate() is None  # told once
    assert tx.phase is TxPhase.CLEAN


def test_f3_commit_not_yet_written_is_rolled_back() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.failover(reattached=False, lost_work=False)
    fate = tx.commit_fate()
    assert fate is not None and fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
    assert fate.rollback_on_broker is False


def test_f3_commit_the_reattached_server_never_received_is_rolled_back_there() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    tx.failover(reattached=True, lost_work=False, commit_received=False)
    fate = tx.commit_fate()
    assert fate is not None
    assert fate.code is ErrorCode.TRANSACTION_ROLLED_BACK and fate.rollback_on_broker


def test_f3_commit_the_reattached_server_received_is_outcome_unknown() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    tx.failover(reattached=True, lost_work=False, commit_received=True)
    fate = tx.commit_fate()
    assert fate is not None and fate.code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN


def test_f3_commit_written_and_cut_before_the_failover_is_applied_is_outcome_unknown() -> None:
    """The transport can report the lost answer before the driver applies the failover:
    a written commit may have happened, whichever comes first."""
    tx = dirty()
    tx.begin_commit()
    tx.commit_written()
    fate = tx.commit_cut()
    assert fate.action is CommitAction.RAISE
    assert fate.code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN
    assert tx.phase is TxPhase.CLEAN
    # The failover applied afterwards finds nothing to decide and leaves no fate behind.
    assert tx.failover(reattached=False, lost_work=False) is False
    assert tx.commit_fate() is None


def test_f3_commit_cut_before_it_was_written_is_rolled_back() -> None:
    tx = dirty()
    tx.begin_commit()
    fate = tx.commit_cut()
    assert fate.code is ErrorCode.TRANSACTION_ROLLED_BACK
    assert not fate.rollback_on_broker and not fate.give_back  # gone with its link
    assert tx.phase is TxPhase.CLEAN


@pytest.mark.parametrize("written", [False, True])
def test_f3_an_interrupted_commit_keeps_the_failovers_decision(written: bool) -> None:
    tx = dirty()
    tx.begin_commit()
    if written:
        tx.commit_written()
    tx.failover(reattached=False, lost_work=False)
    tx.work()  # a new transaction began meanwhile: the interrupted commit must not touch it
    fate = tx.commit_cut()
    expected = (
        ErrorCode.TRANSACTION_OUTCOME_UNKNOWN if written else ErrorCode.TRANSACTION_ROLLED_BACK
    )
    assert fate.code is expected
    assert tx.phase is TxPhase.DIRTY
    assert tx.commit_fate() is None  # told once


def test_a_fate_left_by_a_failover_never_reaches_a_later_commit() -> None:
    tx = dirty()
    tx.begin_commit()
    tx.failover(reattached=False, lost_work=False)  # caught before it was written
    # Nobody took the fate (the commit ended otherwise); the next commit is written, cut.
    tx.work()
    tx.begin_commit()
    tx.commit_written()
    assert tx.commit_cut().code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN


def test_misuse_while_committing_is_an_illegal_state_and_changes_nothing() -> None:
    tx = dirty()
    tx.begin_commit()
    for call in (tx.work, tx.begin_commit, tx.rollback):
        with pytest.raises(IllegalStateError):
            call()
        assert tx.phase is TxPhase.COMMITTING


operations = st.lists(
    st.one_of(
        st.just(("work",)),
        st.just(("begun_on_broker",)),
        st.just(("begin_commit",)),
        st.just(("commit_written",)),
        st.just(("commit_finished",)),
        st.just(("rollback",)),
        st.tuples(
            st.just("failover"), st.booleans(), st.booleans(), st.sampled_from([None, True, False])
        ),
    ),
    max_size=25,
)


@given(operations)
def test_every_phase_and_input(ops: list[tuple[object, ...]]) -> None:
    tx = TransactionState()
    doomed = False  # a failover doomed the current work since the last commit/rollback
    for op in ops:
        phase = tx.phase
        name = op[0]
        try:
            if name == "work":
                tx.work()
            elif name == "begun_on_broker":
                tx.begun_on_broker()
            elif name == "begin_commit":
                decision = tx.begin_commit()
                # A doomed transaction is never committed.
                if doomed:
                    assert decision.action is CommitAction.ROLL_BACK_AND_RAISE
                    doomed = False
                else:
                    assert decision.action is CommitAction.SEND_COMMIT
            elif name == "commit_written":
                tx.commit_written()
            elif name == "commit_finished":
                tx.commit_finished()
                doomed = False
            elif name == "rollback":
                tx.rollback()
                doomed = False
            else:
                _, reattached, lost, received = op
                was_dirty = tx.phase is TxPhase.DIRTY
                result = tx.failover(
                    reattached=bool(reattached), lost_work=bool(lost), commit_received=received
                )  # type: ignore[arg-type]
                if phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT):
                    assert result and tx.commit_fate() is not None and tx.phase is TxPhase.CLEAN
                elif was_dirty and (not reattached or lost):
                    assert result and tx.rollback_only
                    doomed = True
                elif phase is TxPhase.ROLLBACK_ONLY:
                    assert tx.rollback_only
        except IllegalStateError:
            # Misuse leaves the state as it was.
            assert tx.phase is phase
            assert phase in (TxPhase.COMMITTING, TxPhase.COMMIT_SENT)
        assert tx.dirty == (tx.phase is not TxPhase.CLEAN)


@pytest.mark.parametrize(
    ("code", "cause", "raised", "says"),
    [
        (
            ErrorCode.TRANSACTION_ROLLED_BACK,
            None,
            TransactionRolledBackError,
            "lost its connection",
        ),
        (
            ErrorCode.TRANSACTION_ROLLED_BACK,
            CallTimeoutError("slow"),
            TransactionRolledBackError,
            "timed out",
        ),
        (
            ErrorCode.TRANSACTION_OUTCOME_UNKNOWN,
            None,
            TransactionOutcomeUnknownError,
            "may or may not",
        ),
        (
            ErrorCode.TRANSACTION_OUTCOME_UNKNOWN,
            DisconnectedError("gone"),
            DisconnectedError,
            "gone; the commit was sent and may or may not",
        ),
        (
            ErrorCode.TRANSACTION_ROLLED_BACK,
            DisconnectedError("gone"),
            DisconnectedError,
            "gone; the transaction was rolled back",
        ),
    ],
)
def test_an_interrupted_commit_raises_what_its_fate_says(
    code: ErrorCode, cause: BaseException | None, raised: type[Exception], says: str
) -> None:
    """F3, F2: the error a commit caught without an answer raises is decided here alone."""
    error = CommitDecision(CommitAction.RAISE, code).interrupted_error(cause)
    assert type(error) is raised
    assert says in str(error)


def test_a_reconnect_forgets_a_transaction_begun_on_the_broker_with_no_work_yet() -> None:
    """Begun on the broker (a STOMP BEGIN before the first send), clean, then reconnected:
    the new session has no trace of it, so a rollback is local."""
    tx = TransactionState()
    tx.begun_on_broker()
    assert tx.failover(reattached=False, lost_work=False) is False
    assert tx.rollback().rollback_on_broker is False
    kept = TransactionState()
    kept.begun_on_broker()
    kept.failover(reattached=True, lost_work=False)
    assert kept.rollback().rollback_on_broker is True
