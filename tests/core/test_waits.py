"""A call's budget (core/waits.py): time up counts against call_timeout, time failing over
against call_failover_timeout (F1), whichever path waits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.core.waits import LOOK_AGAIN, CallBudget, Expiry, Wait

seconds = st.floats(0, 100, allow_nan=False)
steps = st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.booleans()), max_size=30)


@given(seconds, st.one_of(st.none(), seconds), steps)
def test_time_up_and_time_failing_over_count_against_their_own_budget(
    call_timeout: float, failover_timeout: float | None, waited: list[tuple[float, bool]]
) -> None:
    budget = CallBudget(call_timeout, failover_timeout)
    for seconds_waited, up in waited:
        budget = budget.spent(seconds_waited, up=up)
    up_time = sum(s for s, up in waited if up)
    down_time = sum(s for s, up in waited if not up)
    assert budget.left == pytest.approx(call_timeout - up_time)
    if failover_timeout is None:
        assert budget.failover_left is None
    else:
        assert budget.failover_left == pytest.approx(failover_timeout - down_time)
    expected = (
        Expiry.CALL_TIMEOUT
        if budget.left <= 0
        else Expiry.CALL_FAILOVER_TIMEOUT
        if budget.failover_left is not None and budget.failover_left <= 0
        else None
    )
    assert budget.expiry is expected
    assert 0 <= budget.pause <= LOOK_AGAIN
    if expected is None:
        assert budget.pause > 0


def test_failing_over_never_spends_the_call_timeout() -> None:
    budget = CallBudget(1.0).spent(3600, up=False)
    assert budget.expiry is None
    assert budget.left == 1.0


def test_a_written_call_stops_waiting_for_the_connection_after_call_failover_timeout() -> None:
    budget = CallBudget(30.0, 2.0).spent(1.5, up=False).spent(10, up=True)
    assert budget.expiry is None
    assert budget.spent(0.5, up=False).expiry is Expiry.CALL_FAILOVER_TIMEOUT


def test_the_call_timeout_is_reported_first() -> None:
    assert CallBudget(0.0, 0.0).expiry is Expiry.CALL_TIMEOUT


def test_the_pause_ends_at_the_nearer_budget() -> None:
    assert CallBudget(0.2, 5.0).pause == pytest.approx(0.2)
    assert CallBudget(5.0, 0.1).pause == pytest.approx(0.1)
    assert CallBudget(math.inf).pause == LOOK_AGAIN


@pytest.mark.parametrize("bad", [math.nan, "1", True, None])
def test_a_budget_that_is_not_seconds_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="number of seconds"):
        CallBudget(bad)  # type: ignore[arg-type]


def test_a_wait_without_a_message_of_its_own_says_the_call_timed_out() -> None:
    """What CallTimeoutError says when the waiting call gave no message (a call that only
    waits for the connection to come back, or for room in the window)."""
    wait: Wait[object] = Wait(lambda: False, CallBudget(1.0))
    assert wait.timed_out() == "the call timed out"
