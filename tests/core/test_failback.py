"""Priority failback, decided in the core: the schedule's order, the machine's clean-point
move, the sessions core's blocker and what a receipt covered."""

from __future__ import annotations

import random

import pytest

from hafailover.ack_modes import AckMode
from hafailover.core.failover import (
    CloseTransport,
    Connected,
    Exhausted,
    FailoverMachine,
    FailoverState,
    FailoverStateError,
    InvalidateBrowsers,
    Lost,
    NotifyListener,
    PreferredAnswered,
    Restored,
    StartReconnect,
)
from hafailover.core.inflight import CallKind, SessionsCore
from hafailover.core.schedule import ReconnectSchedule
from hafailover.errors import ErrorCode, InvalidURLError
from hafailover.url import parse_url


def rotation_hosts(url: str, *, connected: str | None = None, limit: int = 4) -> list[str]:
    schedule = ReconnectSchedule(parse_url(url), rng=random.Random(0))
    if connected is not None:
        broker = next(b for b in schedule.rotation.brokers if b.host == connected)
        schedule.rotation.connected_to(broker)
    return [a.broker.host for a in schedule.plan(initial=False, limit=limit)]


def test_priority_reconnects_start_with_the_first_broker_wherever_the_connection_was() -> None:
    url = "failover:(stomp://a,stomp://b,stomp://c)?failover_method=priority"
    assert rotation_hosts(url, connected="c") == ["a", "b", "c", "a"]
    # roundrobin, by contrast, starts with the broker it was on
    assert rotation_hosts(url.replace("priority", "roundrobin"), connected="c")[0] == "c"


def test_only_priority_probes_and_only_away_from_the_preferred_broker() -> None:
    priority = ReconnectSchedule(
        parse_url("failover:(stomp://a,stomp://b)?failover_method=priority")
    )
    a, b = priority.rotation.brokers
    assert priority.rotation.preferred == a
    assert priority.rotation.failback_due(b)
    assert not priority.rotation.failback_due(a)
    roundrobin = ReconnectSchedule(parse_url("failover:(stomp://a,stomp://b)"))
    assert roundrobin.rotation.preferred is None
    assert not roundrobin.rotation.failback_due(roundrobin.rotation.brokers[1])


def up_on(link: int) -> FailoverMachine:
    machine = FailoverMachine(reconnect_enabled=True)
    machine.handle(Connected(parse_url("stomp://b").brokers[0], link=link))
    return machine


def test_a_probe_that_answers_at_a_clean_point_moves_back_like_a_failover() -> None:
    machine = up_on(1)
    effects = machine.handle(PreferredAnswered(link=1))
    assert effects == [CloseTransport(gracefully=True), InvalidateBrowsers(), StartReconnect()]
    assert machine.state is FailoverState.FAILING_OVER
    # the old link's own loss notice, once it is closed, changes nothing
    assert machine.handle(Lost("closed", link=1)) == []
    machine.handle(Connected(parse_url("stomp://a").brokers[0], link=2))
    effects = machine.handle(Restored())
    notice = [e for e in effects if isinstance(e, NotifyListener)]
    assert notice == [NotifyListener(ErrorCode.FAILOVER, reattached=False, failback=True)]
    # the next failover, a loss, is no failback
    machine.handle(Lost("gone", link=2))
    machine.handle(Connected(parse_url("stomp://b").brokers[0], link=3))
    effects = machine.handle(Restored())
    assert [e for e in effects if isinstance(e, NotifyListener)] == [
        NotifyListener(ErrorCode.FAILOVER, reattached=False, failback=False)
    ]


def test_no_move_while_work_is_unfinished_or_about_a_replaced_link() -> None:
    machine = up_on(1)
    assert machine.handle(PreferredAnswered(link=1, blocker="1 call(s) wait")) == []
    assert machine.handle(PreferredAnswered(link=7)) == []
    assert machine.state is FailoverState.CONNECTED
    machine.handle(Lost("gone", link=1))
    assert machine.handle(PreferredAnswered(link=1)) == []
    assert machine.state is FailoverState.FAILING_OVER
    no_reconnect = FailoverMachine(reconnect_enabled=False)
    no_reconnect.handle(Connected(parse_url("stomp://b").brokers[0], link=1))
    assert no_reconnect.handle(PreferredAnswered(link=1)) == []


def test_a_failback_that_finds_no_broker_ends_as_a_disconnect_not_a_failback() -> None:
    machine = up_on(1)
    machine.handle(PreferredAnswered(link=1))
    effects = machine.handle(Exhausted(3, "refused"))
    assert NotifyListener(ErrorCode.DISCONNECT, reason="refused") in effects
    assert not machine.failing_back


def test_the_sessions_core_names_what_a_move_would_cut() -> None:
    core = SessionsCore(1024)
    core.open_session(1, AckMode.AUTO)
    assert core.failback_blocker() is None
    token = core.call(CallKind.SEND, 1)
    assert core.failback_blocker() == "1 call(s) wait for the broker"
    core.abandon(token)
    assert core.failback_blocker() is None

    transacted = core.open_session(2, AckMode.SESSION_TRANSACTED)
    transacted.delivered("t1")
    assert "transaction" in (core.failback_blocker() or "")
    core.close_session(2)

    client = core.open_session(3, AckMode.CLIENT)
    delivery = client.delivered("c1")
    assert "unacknowledged" in (core.failback_blocker() or "")
    client.acknowledge(delivery)
    assert core.failback_blocker() is None


def test_failback_interval_and_priority_parse_and_round_trip() -> None:
    policy = parse_url(
        "failover:(stomp://a,stomp://b)?failover_method=priority&failback_interval=2s"
    )
    assert policy.failback_interval == 2.0
    assert parse_url(policy.unredacted()) == policy
    with pytest.raises(InvalidURLError, match="failback_interval"):
        parse_url("stomp://a?failback_interval=0")


# --- what a receipt covered is never sent again ----------------------------------------------


def windowed_write(core: SessionsCore, token: int | None, **flags: bool) -> int:
    command_id = core.window.record(("frame", token), 10, force=True, **flags)
    if token is not None:
        core.written(token, link=1, command_id=command_id, windowed=True, asked=True)
    return command_id


def test_a_reconnect_resends_only_window_sends_no_receipt_covered() -> None:
    core = SessionsCore(64 * 1024)
    core.open_session(1, AckMode.AUTO)
    windowed_write(core, None, resendable=True)  # confirm=False, before the receipt
    confirmed = core.call(CallKind.SEND, 1, resendable=True, message_id="m1")
    windowed_write(core, confirmed, resendable=True)
    assert core.answered(confirmed).done == (confirmed,)
    later = windowed_write(core, None, resendable=True)  # after it: the broker may lack it
    plan = core.failover(resumed=False)
    assert [c.command_id for c in plan.resend_frames] == [later]


def test_a_failback_waits_for_a_receipt_that_covers_the_window() -> None:
    core = SessionsCore(64 * 1024)
    core.open_session(1, AckMode.DUPS_OK)
    windowed_write(core, None, resendable=True)
    assert core.failback_blocker() == "1 command(s) written since the broker's last receipt"
    sync = core.call(CallKind.SYNC, None)
    windowed_write(core, sync)
    core.answered(sync)
    assert core.unreceipted_commands() == 0 and core.failback_blocker() is None
    assert core.failover(resumed=False).resend_frames == ()


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK])
def test_no_move_while_an_automatic_acknowledge_is_still_to_come(mode: AckMode) -> None:
    """A message handed out in AUTO or DUPS_OK (a listener running on it, or a receive about
    to return it) is acknowledged once that ends: a move before then would cut it."""
    core = SessionsCore(1024)
    rules = core.open_session(1, mode)
    first = rules.delivered("m1")
    assert "acknowledge is still to come" in (core.failback_blocker() or "")
    rules.after_delivery(first)
    assert core.failback_blocker() is None
    second = rules.delivered("m2")
    assert core.failback_blocker() is not None
    rules.listener_failed(second)  # given back to the broker: nothing left in hand
    assert core.failback_blocker() is None


def test_a_failback_counts_as_one_failover_started() -> None:
    machine = up_on(1)
    machine.handle(Lost("gone", link=1))  # a failover first, to the backup
    machine.handle(Connected(parse_url("stomp://b").brokers[0], link=2))
    machine.handle(Restored())
    machine.handle(PreferredAnswered(link=2))
    assert machine.failovers_started == 2
    machine.handle(Connected(parse_url("stomp://a").brokers[0], link=3))
    machine.handle(Restored())
    assert (machine.failovers_started, machine.failovers_completed) == (2, 2)


def test_a_driver_bug_in_the_middle_of_a_failback_still_tells_the_listener() -> None:
    """F2, F10: the move back is a failover whose outcome is owed to the listener; an
    illegal event that makes the machine FAILED leaves it owed, and the Exhausted that ends
    reconnection tells it."""
    machine = up_on(1)
    machine.handle(PreferredAnswered(link=1))
    with pytest.raises(FailoverStateError):
        machine.handle(Restored())
    assert machine.state is FailoverState.FAILED
    effects = machine.handle(Exhausted(1, "a bug"))
    assert NotifyListener(ErrorCode.DISCONNECT, reason="a bug") in effects
