"""The failover state machine: every state against every event (F1, F2, F3, F10, F12)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.core.failover import (
    Admission,
    CancelReconnect,
    CloseRequested,
    CloseTransport,
    Connected,
    Event,
    Exhausted,
    FailoverMachine,
    FailoverState,
    FailoverStateError,
    FailPendingCalls,
    InvalidateBrowsers,
    LearnTopology,
    Lost,
    NotifyListener,
    ReattachSessions,
    RecreateSessions,
    Restored,
    StartReconnect,
    TopologyAnnounced,
    UnblockPendingCalls,
    WakeBlockedCalls,
)
from hafailover.core.inflight import FailoverPlan
from hafailover.errors import ErrorCode
from hafailover.url import BrokerAddress

S = FailoverState
LIVE = BrokerAddress("stomp", "live", 61613)
BACKUP = BrokerAddress("stomp", "backup", 61613)

events = st.one_of(
    st.builds(
        Connected, st.sampled_from([LIVE, BACKUP]), st.booleans(), st.none(), st.integers(0, 2)
    ),
    st.builds(Lost, st.text(max_size=5), st.integers(0, 2)),
    st.just(Restored()),
    st.builds(Exhausted, st.integers(0, 5), st.text(max_size=5)),
    st.builds(TopologyAnnounced, st.just((("backup", 61613),))),
    st.just(CloseRequested()),
)


def machine_in(state: FailoverState, *, reconnect: bool = True) -> FailoverMachine:
    """Drive a fresh machine into ``state`` through legal events only."""
    m = FailoverMachine(reconnect_enabled=True)
    paths: dict[FailoverState, list[Event]] = {
        S.CONNECTING: [],
        S.CONNECTED: [Connected(LIVE)],
        S.FAILING_OVER: [Connected(LIVE), Lost("gone")],
        S.RESTORING: [Connected(LIVE), Lost("gone"), Connected(BACKUP)],
        S.REATTACHED: [Connected(LIVE), Lost("gone"), Connected(LIVE, resumed=True), Restored()],
        S.RECONNECTED: [Connected(LIVE), Lost("gone"), Connected(BACKUP), Restored()],
        S.FAILED: [Connected(LIVE), Lost("gone"), Exhausted(3, "refused")],
        S.CLOSED: [CloseRequested()],
    }
    for event in paths[state]:
        m.handle(event)
    assert m.state is state
    m.reconnect_enabled = reconnect
    return m


def test_first_connection() -> None:
    m = FailoverMachine(reconnect_enabled=True)
    assert m.admit() == (Admission.WAIT, None)
    assert m.handle(Connected(LIVE)) == [WakeBlockedCalls()]
    assert m.state is S.CONNECTED and m.ever_connected and m.broker == LIVE
    assert m.admit() == (Admission.PROCEED, None)


def test_f12_initial_connection_failure_is_not_connected_and_not_told_to_listener() -> None:
    m = FailoverMachine(reconnect_enabled=True)
    effects = m.handle(Exhausted(1, "refused"))
    assert effects == [
        FailPendingCalls(ErrorCode.NOT_CONNECTED),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
    ]
    assert not any(isinstance(e, NotifyListener) for e in effects)
    assert m.admit() == (Admission.RAISE, ErrorCode.NOT_CONNECTED)


def test_f1_calls_wait_while_failing_over() -> None:
    m = machine_in(S.CONNECTED)
    assert m.handle(Lost("socket closed")) == [InvalidateBrowsers(), StartReconnect()]
    assert m.state is S.FAILING_OVER
    assert m.admit() == (Admission.WAIT, None)
    assert m.failovers_started == 1


def test_f3_f4_f10_reattach_carries_out_the_plan_then_tells_listener() -> None:
    m = machine_in(S.FAILING_OVER)
    plan = FailoverPlan(reattached=True, complete=(3,))
    assert m.handle(Connected(LIVE, resumed=True, plan=plan, link=2)) == [ReattachSessions(plan)]
    # F1: calls still wait while the plan is carried out on the new link.
    assert m.state is S.RESTORING and m.admit() == (Admission.WAIT, None)
    assert m.handle(Restored()) == [
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.FAILOVER, reattached=True),
    ]
    assert m.state is S.REATTACHED and m.admit() == (Admission.PROCEED, None)
    assert m.failovers_completed == 1


def test_f3_f5_f10_reconnect_recreates_then_unblocks_what_the_plan_gave_up() -> None:
    m = machine_in(S.FAILING_OVER)
    plan = FailoverPlan(reattached=False, resend=(1,), unblock=(2, 4))
    assert m.handle(Connected(BACKUP, plan=plan, link=2)) == [RecreateSessions(plan)]
    assert m.state is S.RESTORING and m.failovers_completed == 0
    assert m.handle(Restored()) == [
        UnblockPendingCalls(ErrorCode.UNBLOCKED, (2, 4)),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.FAILOVER, reattached=False),
    ]
    assert m.state is S.RECONNECTED and m.broker == BACKUP and m.failovers_completed == 1


def test_a_loss_noticed_several_times_is_one_failover() -> None:
    """The reader, a failed write on an application's thread and a heartbeat may each
    report the same loss, in any order: only the first notice about the current link
    counts."""
    m = FailoverMachine(reconnect_enabled=True)
    m.handle(Connected(LIVE, link=1))
    assert m.handle(Lost("write failed", link=1)) == [InvalidateBrowsers(), StartReconnect()]
    assert m.handle(Lost("connection closed", link=1)) == []
    assert m.handle(Lost("heart-beat timeout", link=1)) == []
    assert m.state is S.FAILING_OVER and m.failovers_started == 1


def test_a_late_notice_about_a_replaced_link_changes_nothing() -> None:
    m = FailoverMachine(reconnect_enabled=True)
    m.handle(Connected(LIVE, link=1))
    m.handle(Lost("gone", link=1))
    m.handle(Connected(BACKUP, plan=FailoverPlan(reattached=False), link=2))
    assert m.handle(Lost("late reader notice", link=1)) == []
    assert m.state is S.RESTORING
    m.handle(Restored())
    assert m.handle(Lost("late heartbeat", link=1)) == []
    assert m.state is S.RECONNECTED


def test_a_link_lost_while_restored_fails_that_attempt_only() -> None:
    m = FailoverMachine(reconnect_enabled=True)
    m.handle(Connected(LIVE, link=1))
    m.handle(Lost("gone", link=1))
    m.handle(Connected(BACKUP, plan=FailoverPlan(reattached=False), link=2))
    # No new reconnect: the schedule running the attempt goes on; nobody is told yet.
    assert m.handle(Lost("gone too", link=2)) == []
    assert m.state is S.FAILING_OVER and m.admit() == (Admission.WAIT, None)
    plan = FailoverPlan(reattached=False, unblock=(7,))
    assert m.handle(Connected(LIVE, plan=plan, link=3)) == [RecreateSessions(plan)]
    effects = m.handle(Restored())
    assert effects[0] == UnblockPendingCalls(ErrorCode.UNBLOCKED, (7,))
    assert sum(isinstance(e, NotifyListener) for e in effects) == 1


@pytest.mark.parametrize("state", [S.CONNECTING, S.FAILING_OVER])
def test_a_link_lost_while_being_opened_is_a_failed_attempt_not_a_restore(
    state: FailoverState,
) -> None:
    """The loss of the link an attempt is opening can be reported (by its reader or its
    heartbeat) before the driver makes it current. It is remembered: its Connected is a
    failed attempt, so the machine never restores a dead link whose loss nobody will
    report again (issue 17: a consumer that waits in receive() then waits for ever)."""
    m = machine_in(state)
    before = m.link
    assert m.handle(Lost("connection closed", link=5)) == []
    assert m.state is state and m.link_known_lost(5)
    plan = FailoverPlan(reattached=True)
    assert m.handle(Connected(BACKUP, resumed=True, plan=plan, link=5)) == []
    assert m.state is state and m.link == before and m.admit() == (Admission.WAIT, None)
    # The next attempt's link is restored as usual, and forgets the dead one.
    effects = m.handle(Connected(LIVE, resumed=True, plan=plan, link=6))
    assert m.link == 6 and not m.link_known_lost(5)
    if state is S.FAILING_OVER:
        assert effects == [ReattachSessions(plan)] and m.state is S.RESTORING
    else:
        assert effects == [WakeBlockedCalls()] and m.state is S.CONNECTED


def test_a_late_notice_about_the_link_the_failover_started_from_is_not_remembered() -> None:
    m = machine_in(S.CONNECTED)
    m.handle(Lost("write failed", link=m.link))
    assert m.handle(Lost("connection closed", link=m.link)) == []
    assert not m.link_known_lost(m.link)


def test_f2_f10_a_driver_bug_in_the_middle_of_a_failover_still_tells_the_listener() -> None:
    """An illegal event while failing over moves the machine to FAILED with the loss not
    yet told; the Exhausted that ends reconnection tells it, once, and fails the calls."""
    m = machine_in(S.FAILING_OVER)
    with pytest.raises(FailoverStateError):
        m.handle(Restored())
    assert m.state is S.FAILED
    assert m.handle(Exhausted(1, "a bug")) == [
        FailPendingCalls(ErrorCode.DISCONNECT),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason="a bug"),
    ]
    assert m.handle(Exhausted(1, "again")) == []
    assert m.admit() == (Admission.RAISE, ErrorCode.DISCONNECT)


def test_a_machine_that_failed_with_nothing_untold_stays_silent() -> None:
    m = machine_in(S.FAILED)
    assert m.handle(Exhausted(1, "late")) == []
    m = machine_in(S.RECONNECTED)
    with pytest.raises(FailoverStateError):
        m.handle(Restored())
    assert m.handle(Exhausted(1, "late")) == []


def test_f2_exhausted_disconnects_everyone() -> None:
    m = machine_in(S.FAILING_OVER)
    effects = m.handle(Exhausted(5, "refused"))
    assert effects == [
        FailPendingCalls(ErrorCode.DISCONNECT),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason="refused"),
    ]
    assert m.admit() == (Admission.RAISE, ErrorCode.DISCONNECT)


def test_f2_f10_loss_without_reconnect_is_final_and_told_once() -> None:
    m = machine_in(S.CONNECTED, reconnect=False)
    effects = m.handle(Lost("reset"))
    assert m.state is S.FAILED
    assert [e for e in effects if isinstance(e, NotifyListener)] == [
        NotifyListener(ErrorCode.DISCONNECT, reason="reset")
    ]


@pytest.mark.parametrize("state", [S.CONNECTING, S.FAILING_OVER])
def test_f2_close_releases_all_waiters_and_stops_reconnecting(state: FailoverState) -> None:
    m = machine_in(state)
    effects = m.handle(CloseRequested())
    assert effects == [
        CancelReconnect(),
        FailPendingCalls(ErrorCode.CLOSED),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
    ]
    assert m.admit() == (Admission.RAISE, ErrorCode.CLOSED)


@pytest.mark.parametrize("state", [S.CONNECTED, S.REATTACHED, S.RECONNECTED])
def test_close_while_up(state: FailoverState) -> None:
    m = machine_in(state)
    assert m.handle(CloseRequested()) == [
        CloseTransport(),
        FailPendingCalls(ErrorCode.CLOSED),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
    ]


@pytest.mark.parametrize("state", [S.REATTACHED, S.RECONNECTED])
def test_a_second_failure_starts_a_new_failover(state: FailoverState) -> None:
    m = machine_in(state)
    assert m.handle(Lost("again")) == [InvalidateBrowsers(), StartReconnect()]
    assert m.failovers_started == 2


def test_late_connection_after_close_is_closed() -> None:
    for state in (S.CLOSED, S.FAILED):
        assert machine_in(state).handle(Connected(LIVE)) == [CloseTransport()]


@pytest.mark.parametrize("state", list(FailoverState))
def test_topology_is_learned_or_ignored_but_never_an_error(state: FailoverState) -> None:
    m = machine_in(state)
    effects = m.handle(TopologyAnnounced((("b", 1),)))
    assert m.state is state
    expected = [] if state in (S.FAILED, S.CLOSED) else [LearnTopology((("b", 1),))]
    assert effects == expected


ILLEGAL = [
    (S.CONNECTING, Restored()),
    (S.FAILING_OVER, Restored()),
    (S.CONNECTED, Restored()),
    (S.REATTACHED, Restored()),
    (S.RECONNECTED, Restored()),
    (S.RESTORING, Connected(LIVE)),
    (S.CONNECTED, Connected(LIVE)),
    (S.REATTACHED, Connected(LIVE)),
    (S.RECONNECTED, Connected(BACKUP, resumed=True)),
    (S.CONNECTED, Exhausted(1, "x")),
    (S.REATTACHED, Exhausted(1, "x")),
    (S.RECONNECTED, Exhausted(1, "x")),
]


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_illegal_events_are_sticky_errors(state: FailoverState, event: Event) -> None:
    m = machine_in(state)
    with pytest.raises(FailoverStateError, match="not valid"):
        m.handle(event)
    assert m.state is S.FAILED
    assert m.admit()[0] is Admission.RAISE


@given(
    st.sampled_from(list(FailoverState)),
    st.booleans(),
    st.lists(events, max_size=12),
)
def test_every_state_and_input_is_legal_or_a_clean_error(
    state: FailoverState, reconnect: bool, inputs: list[Event]
) -> None:
    m = machine_in(state, reconnect=reconnect)
    listener_calls = 0
    losses = 0
    owed = 1 if state in (S.FAILING_OVER, S.RESTORING) else 0
    for event in inputs:
        before = m.state
        known_dead = isinstance(event, Connected) and m.link_known_lost(event.link)
        try:
            effects = m.handle(event)
        except FailoverStateError:
            assert (before, type(event)) in {(s, type(e)) for s, e in ILLEGAL}
            assert m.state is S.FAILED
            continue
        listener_calls += sum(isinstance(e, NotifyListener) for e in effects)
        if (
            isinstance(event, Lost)
            and m.state in (S.FAILING_OVER, S.FAILED)
            and before in (S.CONNECTED, S.REATTACHED, S.RECONNECTED)
        ):
            losses += 1
        # Effects are ordered: waiters are released before the listener hears.
        kinds = [type(e) for e in effects]
        if NotifyListener in kinds and WakeBlockedCalls in kinds:
            assert kinds.index(WakeBlockedCalls) < kinds.index(NotifyListener)
        # admit() agrees with the state.
        admission, code = m.admit()
        if m.state in (S.CONNECTED, S.REATTACHED, S.RECONNECTED):
            assert admission is Admission.PROCEED
        elif m.state in (S.CONNECTING, S.FAILING_OVER, S.RESTORING):
            assert admission is Admission.WAIT
        else:
            assert admission is Admission.RAISE and code is not None
        # Terminal states stay terminal.
        if before in (S.FAILED, S.CLOSED):
            assert m.state in (S.FAILED, S.CLOSED)
        # A link reported lost before it was current is never restored.
        if known_dead and before in (S.CONNECTING, S.FAILING_OVER):
            assert effects == [] and m.state is before
    # F10: the listener never hears more than once per lost connection.
    assert listener_calls <= losses + owed
    # F2, F10: once reconnection ends, every loss has been told (unless closed first).
    if m.is_up:
        return  # no reconnection running to end
    listener_calls += sum(isinstance(e, NotifyListener) for e in m.handle(Exhausted(1, "the end")))
    if m.state is S.FAILED and m.ever_connected:
        assert listener_calls == losses + owed


@given(st.lists(events, max_size=30))
def test_f11_browsers_are_invalidated_exactly_when_the_link_is_lost_or_the_connection_ends(
    script: list[Event],
) -> None:
    """The one place F11 is decided: the first notice of the current link's loss, and
    every way the connection ends, invalidate the browsers iterating; nothing else does
    (a repeated notice, a stale link's, a completed failover)."""
    m = FailoverMachine(reconnect_enabled=True)
    for event in script:
        before = m.state
        current = m.link
        try:
            effects = m.handle(event)
        except FailoverStateError:
            continue
        invalidated = InvalidateBrowsers() in effects
        starts_failover = (
            isinstance(event, Lost)
            and event.link == current
            and before in (S.CONNECTED, S.REATTACHED, S.RECONNECTED)
        )
        ends = any(isinstance(effect, FailPendingCalls) for effect in effects)
        assert invalidated == (starts_failover or ends), (before, event, effects)
