"""The calls in flight's edges that mutation testing found unguarded (docs/testing.md).

Each test names the behaviour it pins; the mutants it kills are noted in docs/testing.md.
"""

from __future__ import annotations

from hafailover.ack_modes import AckMode, ClientAckRules
from hafailover.core.inflight import Answer, CallKind, SessionsCore

LINK = 1


def windowed_core() -> SessionsCore:
    return SessionsCore(64 * 1024)


def write(core: SessionsCore, token: int | None, *, cumulative: bool = True, **flags: bool) -> int:
    """Write a frame as a windowed link does (``cumulative``: it shares later receipts)."""
    command_id = core.window.record(("frame", token), 10, force=True, **flags)
    if token is not None:
        core.written(token, link=LINK, command_id=command_id, windowed=cumulative, asked=True)
    return command_id


def test_a_session_keeps_its_id_and_closing_it_forgets_its_rules() -> None:
    core = windowed_core()
    assert core.open_session(7, AckMode.CLIENT).session_id == 7
    core.open_session(8, AckMode.AUTO)
    core.close_session(7)
    assert set(core.rules) == {8}
    core.close_session(7)  # closing twice is harmless


def test_a_call_registers_what_it_is_given_and_nothing_else() -> None:
    core = windowed_core()
    bare = core.call(CallKind.END, 1)
    call = core.calls[bare]
    assert (call.size, call.message_id, call.subscription, call.tag, call.commit) == (
        0,
        "",
        "",
        "",
        False,
    )
    assert core.unconfirmed_bytes == 0
    ack = core.call(CallKind.ACK, 1, subscription="s", tag="t7", message_id="m7")
    assert (core.calls[ack].subscription, core.calls[ack].tag) == ("s", "t7")


def test_only_a_commit_of_that_session_is_committing() -> None:
    core = windowed_core()
    core.call(CallKind.SEND, 1)
    core.call(CallKind.END, 1)  # a rollback
    core.call(CallKind.END, 2, commit=True)  # another session's commit
    assert not core.committing(1)
    assert core.committing(2)


def test_outstanding_names_the_calls_of_one_session_and_kind() -> None:
    core = windowed_core()
    send = core.call(CallKind.SEND, 1)
    core.call(CallKind.ACK, 1)
    core.call(CallKind.SEND, 2)
    later = core.call(CallKind.SEND, 1)
    assert core.outstanding(1, CallKind.SEND) == (send, later)


def test_no_token_asks_no_receipt() -> None:
    core = windowed_core()
    assert not core.asks_receipt(None, windowed=False, waited_for=True)


def test_written_records_the_link_and_only_windowed_work_shares_receipts() -> None:
    core = windowed_core()
    first = core.call(CallKind.SEND, 1)
    second = core.call(CallKind.SEND, 1)
    for token in (first, second):
        core.written(token, link=5, command_id=-1, windowed=False, asked=True)
    assert core.calls[first].link == 5
    assert not core.calls[first].cumulative
    assert core.answered(second) == Answer((second,))  # its own receipt, for itself only
    assert first in core.calls


def test_an_answer_for_no_call_ends_nothing() -> None:
    assert windowed_core().answered(99) == Answer(())


def test_only_sends_the_broker_confirmed_are_counted_confirmed() -> None:
    core = windowed_core()
    confirmed = core.call(CallKind.SEND, 1)
    abandoned = core.call(CallKind.SEND, 1)
    acknowledged = core.call(CallKind.ACK, 1)
    core.answered(confirmed)  # its own receipt, not a cumulative one
    core.abandon(abandoned)
    core.answered(acknowledged)
    assert core.confirmed == 1
    assert core.release([core.call(CallKind.SEND, 1)]) != ()
    assert core.confirmed == 1
    core.count_sent()
    core.count_sent()
    assert core.sent == 2


def test_a_confirmation_says_whether_it_freed_room() -> None:
    core = windowed_core()
    assert not core.confirmed_upto(3)  # nothing was sent: ignored
    write(core, None)
    assert core.confirmed_upto(0)  # one command freed
    assert not core.confirmed_upto(0)  # freed already


def test_flow_control_follows_the_window_when_the_link_has_one() -> None:
    core = SessionsCore(25)
    write(core, None)  # 10 bytes held
    assert core.has_room(15, windowed=True)
    assert not core.has_room(16, windowed=True)


def test_flow_control_is_off_with_the_window_off() -> None:
    core = SessionsCore(-1)
    core.call(CallKind.SEND, 1, size=60)
    assert core.has_room(1000, windowed=False)


def test_a_reattach_counts_every_replay() -> None:
    core = windowed_core()
    write(core, None)
    write(core, None)
    core.failover(resumed=True, last_received=0)  # command 1 replayed
    assert core.replayed == 1
    core.failover(resumed=True, last_received=0)  # again
    assert core.replayed == 2


def test_a_reattach_completes_the_first_command_the_server_had() -> None:
    core = windowed_core()
    send = core.call(CallKind.SEND, 1)
    write(core, send)  # command 0, not stamped: the server had it, so it is done
    rollback = core.call(CallKind.END, 1)
    write(core, rollback)
    plan = core.failover(resumed=True, last_received=1)
    assert plan.complete == (send, rollback)
    assert plan.resend == () and plan.unblock == ()
    assert core.confirmed == 1


def test_a_reattach_applies_each_sessions_rules_as_a_reattach() -> None:
    core = windowed_core()
    rules = core.open_session(1, AckMode.CLIENT)
    assert isinstance(rules, ClientAckRules)
    rules.delivered("d1")
    write(core, None)
    plan = core.failover(resumed=True, last_received=0)
    assert plan.reattached
    assert set(plan.outcomes) == {1}
    assert not plan.outcomes[1].dirty and plan.outcomes[1].stale == ()
    assert not plan.sessions[0].dirty


def test_a_send_resent_after_a_reattach_waits_for_its_own_receipt() -> None:
    core = windowed_core()
    resent = core.call(CallKind.SEND, 1, resendable=True, message_id="m0")
    write(core, resent)  # command 0: the server had it, its answer was lost
    replayed = core.call(CallKind.SEND, 1, message_id="m1")
    write(core, replayed)  # command 1: replayed
    plan = core.failover(resumed=True, last_received=0)
    assert plan.resend == (resent,)
    assert core.calls[resent].cumulative is False
    # The replayed send's receipt confirms what went before it on the window, and the
    # resent send is no longer part of that order.
    assert core.answered(replayed) == Answer((replayed,))
    assert resent in core.calls


def test_a_resend_takes_its_new_link_and_id_and_is_counted() -> None:
    core = windowed_core()
    for _ in range(3):
        write(core, None)
    first = core.call(CallKind.SEND, 1, resendable=True, message_id="a")
    second = core.call(CallKind.SEND, 1, resendable=True, message_id="b")
    write(core, first)  # command 3
    write(core, second)  # command 4
    plan = core.failover(resumed=False)
    assert plan.resend == (first, second)
    core.resent_on(first, link=2, command_id=0)
    core.resent_on(second, link=2, command_id=1)
    call = core.calls[first]
    assert (call.link, call.command_id, call.cumulative) == (2, 0, False)
    assert (core.resent, core.sent) == (2, 2)


def test_a_reconnect_leaves_no_receipt_owed() -> None:
    core = windowed_core()
    token = core.call(CallKind.SEND, 1)
    core.written(token, link=LINK, command_id=0, windowed=True, asked=False)
    assert core.sync_needed()
    core.failover(resumed=False)
    assert not core.sync_needed()
    other = core.call(CallKind.SEND, 1)
    core.written(other, link=LINK, command_id=0, windowed=True, asked=False)
    core.release_all()
    assert not core.sync_needed()


def test_a_reconnect_resends_the_first_command_once() -> None:
    core = windowed_core()
    stamped = core.call(CallKind.SEND, 1, resendable=True, message_id="m0")
    write(core, stamped, resendable=True)  # command 0, waited for
    plan = core.failover(resumed=False)
    assert plan.resend == (stamped,)
    assert plan.resend_frames == ()  # not a second time as a window-only frame


def test_a_reconnect_tells_auto_rules_exactly_the_acknowledges_it_lost() -> None:
    core = windowed_core()
    core.open_session(1, AckMode.AUTO)
    ack = core.call(CallKind.ACK, 1, subscription="s", tag="t1", message_id="m1")
    write(core, ack)
    send = core.call(CallKind.SEND, 1, message_id="m2")
    write(core, send)
    plan = core.failover(resumed=False)
    assert plan.outcomes[1].expect_again == frozenset({("s", "m1")})
    rules = core.rules[1]
    assert rules.redelivery_expected("s", "m1")
    assert not rules.redelivery_expected("", "m2")


def test_an_abandoned_call_is_handed_back_and_forgotten() -> None:
    core = windowed_core()
    token = core.call(CallKind.ACK, 1, tag="t1")
    call = core.abandon(token)
    assert call is not None and call.tag == "t1"
    assert token not in core.calls
    assert core.abandon(token) is None


def test_a_reattach_releases_what_was_never_written_except_sends() -> None:
    core = windowed_core()
    write(core, None)
    ack = core.call(CallKind.ACK, 1, tag="t1")  # its write failed: no answer will come
    send = core.call(CallKind.SEND, 1, message_id="m1")  # never left: sending is no copy
    plan = core.failover(resumed=True, last_received=0)
    assert plan.unblock == (ack,)
    assert plan.resend == (send,)


def test_a_reconnect_gives_each_session_its_own_part_of_the_report() -> None:
    core = windowed_core()
    core.open_session(1, AckMode.AUTO)
    core.open_session(2, AckMode.AUTO)
    stamped = core.call(CallKind.SEND, 2, resendable=True, message_id="m1")
    write(core, stamped)
    plan = core.failover(resumed=False)
    assert [(p.session_id, p.replayed, p.resent) for p in plan.sessions] == [
        (1, (), ()),
        (2, (), ("m1",)),
    ]
    assert core.calls[stamped].cumulative is False  # resent with a receipt of its own


def test_only_the_first_session_reports_what_a_reattach_replayed() -> None:
    core = windowed_core()
    core.open_session(1, AckMode.AUTO)
    core.open_session(2, AckMode.AUTO)
    write(core, None)
    write(core, None)
    plan = core.failover(resumed=True, last_received=0)
    assert [(p.session_id, p.replayed) for p in plan.sessions] == [(1, (1,)), (2, ())]


def test_a_reconnect_forgets_what_the_old_sessions_receipts_covered() -> None:
    # Ids start again at 0 on the new session: a receipt of the old one covers none of them,
    # so they count as unreceipted (a failback waits for them) and a second reconnect
    # resends the stamped ones nobody waits for.
    core = windowed_core()
    token = core.call(CallKind.SEND, 1)
    for _ in range(3):
        write(core, None)  # commands 0..2, sent with confirm=False
    write(core, token)  # command 3
    core.answered(token)  # its receipt covers 0..3
    assert core.unreceipted_commands() == 0
    core.failover(resumed=False)
    write(core, None, resendable=True)  # commands 0 and 1 of the new session
    write(core, None, resendable=True)
    assert core.unreceipted_commands() == 2
    assert core.failback_blocker() == "2 command(s) written since the broker's last receipt"
    plan = core.failover(resumed=False)
    assert [c.command_id for c in plan.resend_frames] == [0, 1]
