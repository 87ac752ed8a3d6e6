"""Acknowledge-mode rules (F6, F7, F8, F9, F14) after failover."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.ack_modes import (
    PIPELINED_ACKS,
    AckAction,
    AckMode,
    AutoAckRules,
    ClientAckRules,
    ConfirmFirst,
    LinkReliability,
    TransactedAckRules,
    check_link_reliability,
    rules_for,
)
from hafailover.errors import ConfigurationError, ErrorCode, IllegalStateError


def test_f6_auto_acknowledges_each_message_after_delivery() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    delivery = rules.delivered("m1")
    decision = rules.after_delivery(delivery)
    assert decision.action is AckAction.SEND and decision.tags == ("m1",)


def test_f6_auto_reports_an_ack_caught_by_failover() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    delivery = rules.delivered("m1")
    outcome = rules.failover(reattached=False)
    assert outcome.discard_prefetched and not outcome.dirty
    decision = rules.after_delivery(delivery)
    assert decision.action is AckAction.RAISE
    assert decision.code is ErrorCode.ACKNOWLEDGE_FAILED


def test_f6_auto_pipelines_only_what_its_sender_named() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    assert rules.pipelines(sender_id=True, block_on_acknowledge=False)
    assert not rules.pipelines(sender_id=False, block_on_acknowledge=False)
    assert not rules.pipelines(sender_id=True, block_on_acknowledge=True)
    for mode in (AckMode.CLIENT, AckMode.SESSION_TRANSACTED):
        # No automatic acknowledge to confirm.
        assert not rules_for(mode, 1).pipelines(sender_id=True, block_on_acknowledge=False)


def test_f6_a_reconnect_expects_again_what_was_handed_out_before_the_last() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    for tag in ("t1", "t2", "t3"):
        rules.delivered(tag)
    lost = (("s", "t1", "m1"), ("s", "t2", ""), ("s", "t3", "m3"))  # t2: no sender id
    outcome = rules.failover(reattached=False, lost_acks=lost)
    assert outcome.expect_again == frozenset({("s", "m1")})  # t3 was the last: may come
    assert rules.redelivery_expected("s", "m1")
    # Still expected: the acknowledge that drops it may be lost to another reconnect.
    assert rules.redelivery_expected("s", "m1")
    assert not rules.redelivery_expected("other subscription", "m1")  # another's copy
    assert not rules.redelivery_expected("s", "m3")
    assert not rules.redelivery_expected("s", None)


def test_f6_a_reattach_expects_nothing_again() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    rules.delivered("t1")
    rules.delivered("t2")
    outcome = rules.failover(reattached=True, lost_acks=(("s", "t1", "m1"),))
    assert outcome.expect_again == frozenset()
    assert not rules.redelivery_expected("s", "m1")


def test_f6_what_waits_for_an_acknowledge() -> None:
    confirm_first = AutoAckRules.confirm_first
    # Not pipelined: the next message waits for it; pipelined: only once it ended (to
    # report how), or once PIPELINED_ACKS are in flight.
    assert confirm_first(last_pipelined=False, last_done=False, in_flight=0) is ConfirmFirst.LAST
    assert confirm_first(last_pipelined=True, last_done=False, in_flight=0) is ConfirmFirst.NONE
    assert confirm_first(last_pipelined=True, last_done=True, in_flight=3) is ConfirmFirst.LAST
    assert (
        confirm_first(last_pipelined=True, last_done=False, in_flight=PIPELINED_ACKS)
        is ConfirmFirst.OLDEST
    )


@pytest.mark.parametrize(
    ("code", "last", "action", "reported"),
    [
        (ErrorCode.UNBLOCKED, True, AckAction.RAISE, ErrorCode.ACKNOWLEDGE_FAILED),
        (ErrorCode.CONNECTION_TIMEDOUT, True, AckAction.RAISE, ErrorCode.ACKNOWLEDGE_FAILED),
        (ErrorCode.PROTOCOL, True, AckAction.RAISE, ErrorCode.PROTOCOL),
        # An earlier one cut by the failover is the failover's (replayed, or dropped again).
        (ErrorCode.UNBLOCKED, False, AckAction.NOTHING, None),
        (ErrorCode.NOT_CONNECTED, False, AckAction.NOTHING, None),
        # Anything else: that message may come again, and the application hears it.
        (ErrorCode.CONNECTION_TIMEDOUT, False, AckAction.RAISE, ErrorCode.ACKNOWLEDGE_FAILED),
        (ErrorCode.PROTOCOL, False, AckAction.RAISE, ErrorCode.ACKNOWLEDGE_FAILED),
    ],
)
def test_f6_a_failed_acknowledge_is_reported_unless_the_failover_covers_it(
    code: ErrorCode, last: bool, action: AckAction, reported: ErrorCode | None
) -> None:
    decision = AutoAckRules.ack_failed(code, last=last)
    assert decision.action is action
    assert decision.code is reported


@given(st.lists(st.integers(min_value=0, max_value=5000), max_size=40))
def test_f6_the_expected_redeliveries_stay_bounded(sizes: list[int]) -> None:
    rules = rules_for(AckMode.AUTO, 1)
    serial = 0
    for size in sizes:
        lost = []
        for _ in range(size):
            serial += 1
            rules.delivered(f"t{serial}")
            lost.append(("s", f"t{serial}", f"m{serial}"))
        rules.failover(reattached=False, lost_acks=tuple(lost))
        assert len(rules._expected) <= 4 * PIPELINED_ACKS  # type: ignore[attr-defined]
    if sizes and sizes[-1] >= 2:
        assert rules.redelivery_expected("s", f"m{serial - 1}")  # the newest are kept


def test_f7_dups_ok_drops_stale_acks_silently() -> None:
    rules = rules_for(AckMode.DUPS_OK, 1)
    delivery = rules.delivered("m1")
    rules.failover(reattached=False)
    assert rules.after_delivery(delivery).action is AckAction.DROP
    fresh = rules.delivered("m2")
    assert rules.after_delivery(fresh).action is AckAction.SEND


@pytest.mark.parametrize("mode", list(AckMode))
def test_reattach_changes_nothing(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    delivery = rules.delivered("m1")
    outcome = rules.failover(reattached=True)
    assert outcome.stale == () and not outcome.dirty and not outcome.discard_prefetched
    assert not rules.is_stale(delivery)


def test_f8_client_dirty_session_acknowledge_recovers_and_raises() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    old = [rules.delivered(f"m{i}") for i in range(3)]
    outcome = rules.failover(reattached=False)
    assert outcome.dirty and outcome.stale == ("m0", "m1", "m2") and outcome.discard_prefetched
    # Nothing new delivered since failover: the recover only marks the session clean.
    decision = rules.acknowledge(old[0])
    assert decision.action is AckAction.RAISE
    assert decision.code is ErrorCode.ACKNOWLEDGE_STALE
    assert decision.recover is False
    # Clean now: new deliveries acknowledge normally.
    fresh = rules.delivered("n1")
    assert rules.acknowledge(fresh).tags == ("n1",)


def test_f8_client_full_recover_when_new_messages_were_delivered() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    rules.delivered("m0")
    rules.failover(reattached=False)
    fresh = rules.delivered("n1")
    decision = rules.acknowledge(fresh)
    assert decision.action is AckAction.RAISE and decision.recover is True


def test_f8_recover_after_failover_succeeds_and_cleans() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    assert isinstance(rules, ClientAckRules)
    rules.delivered("m0")
    rules.failover(reattached=False)
    rules.delivered("n1")
    assert rules.recover().redeliver == ("n1",)
    assert not rules.dirty
    fresh = rules.delivered("n2")
    assert rules.acknowledge(fresh).tags == ("n2",)


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL])
@pytest.mark.parametrize("second", ["reconnect", "reattach"])
def test_f8_a_dirty_session_stays_dirty_through_a_second_failover(
    mode: AckMode, second: str
) -> None:
    """Nothing was acknowledged or recovered between two failovers: the second one finds
    no unacknowledged message, and the session must still be dirty."""
    rules = rules_for(mode, 1)
    old = rules.delivered("m0")
    assert rules.failover(reattached=False).dirty
    outcome = rules.failover(reattached=second == "reattach")
    assert outcome.dirty or second == "reattach"
    assert isinstance(rules, ClientAckRules) and rules.dirty
    decision = rules.acknowledge(old)
    assert decision.action is AckAction.RAISE
    assert decision.code is ErrorCode.ACKNOWLEDGE_STALE
    assert not rules.dirty  # the implicit recover cleaned it


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK])
def test_a_listener_that_raises_gives_its_message_back_in_the_automatic_modes(
    mode: AckMode,
) -> None:
    rules = rules_for(mode, 1)
    delivery = rules.delivered("t1")
    decision = rules.listener_failed(delivery)
    assert decision.action is AckAction.REDELIVER and decision.tags == ("t1",)
    # One of a session a reconnect replaced: the broker delivers it again anyway.
    stale = rules.delivered("t2")
    rules.failover(reattached=False)
    assert rules.listener_failed(stale).action is AckAction.NOTHING


@pytest.mark.parametrize(
    "mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL, AckMode.SESSION_TRANSACTED]
)
def test_a_listener_that_raises_leaves_the_message_to_the_application(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    assert rules.listener_failed(rules.delivered("t1")).action is AckAction.NOTHING


def test_f8_clean_client_session_fails_over_silently() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    acked = rules.delivered("m0")
    rules.acknowledge(acked)
    outcome = rules.failover(reattached=False)
    assert not outcome.dirty and outcome.stale == ()
    assert rules.acknowledge(acked).action is AckAction.NOTHING


def test_client_acknowledge_is_cumulative_and_individual_is_not() -> None:
    client = rules_for(AckMode.CLIENT, 1)
    deliveries = [client.delivered(f"m{i}") for i in range(3)]
    assert client.acknowledge(deliveries[1]).tags == ("m0", "m1", "m2")
    individual = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    deliveries = [individual.delivered(f"m{i}") for i in range(3)]
    assert individual.acknowledge(deliveries[1]).tags == ("m1",)
    assert individual.acknowledge(deliveries[1]).action is AckAction.NOTHING


@pytest.mark.parametrize("mode", list(AckMode))
def test_acknowledging_another_sessions_message_is_misuse(mode: AckMode) -> None:
    mine, theirs = rules_for(mode, 1), rules_for(mode, 2)
    with pytest.raises(IllegalStateError, match="belongs to session 2"):
        mine.acknowledge(theirs.delivered("m1"))


def test_f9_transacted_receive_dirties_and_failover_dooms() -> None:
    rules = rules_for(AckMode.SESSION_TRANSACTED, 1)
    assert isinstance(rules, TransactedAckRules)
    rules.delivered("m1")
    assert rules.transaction.dirty
    outcome = rules.failover(reattached=False)
    assert outcome.dirty and outcome.stale == ("m1",)
    assert rules.transaction.rollback_only


def test_f9_transacted_reattach_without_loss_is_transparent() -> None:
    rules = rules_for(AckMode.SESSION_TRANSACTED, 1)
    assert isinstance(rules, TransactedAckRules)
    rules.delivered("m1")
    outcome = rules.failover(reattached=True)
    assert not outcome.dirty
    assert rules.received_in_transaction() == ("m1",)


@pytest.mark.parametrize(
    ("mode", "reliability", "ok"),
    [
        (AckMode.NO_ACKNOWLEDGE, LinkReliability.AT_LEAST_ONCE, False),
        (AckMode.NO_ACKNOWLEDGE, LinkReliability.EXACTLY_ONCE, False),
        (AckMode.NO_ACKNOWLEDGE, LinkReliability.UNRELIABLE, True),
        (AckMode.NO_ACKNOWLEDGE, LinkReliability.AT_MOST_ONCE, True),
        (AckMode.CLIENT, LinkReliability.AT_MOST_ONCE, False),
        (AckMode.SESSION_TRANSACTED, LinkReliability.UNRELIABLE, False),
        (AckMode.AUTO, LinkReliability.AT_LEAST_ONCE, True),
        (AckMode.CLIENT, None, True),
    ],
)
def test_f14_link_reliability_must_agree_with_ack_mode(
    mode: AckMode, reliability: LinkReliability | None, ok: bool
) -> None:
    if ok:
        check_link_reliability(mode, reliability)
    else:
        with pytest.raises(ConfigurationError, match="contradicts acknowledge mode"):
            check_link_reliability(mode, reliability)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("deliver"), st.integers(0, 50)),
        st.tuples(st.just("ack"), st.integers(0, 50)),
        st.tuples(st.just("recover"), st.just(0)),
        st.tuples(st.just("failover"), st.booleans()),
    ),
    max_size=30,
)


@given(st.sampled_from([AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL]), steps)
def test_client_modes_never_send_a_stale_ack(mode: AckMode, ops: list[tuple[str, object]]) -> None:
    """Whatever happens, an acknowledgement sent to the broker names only current deliveries."""
    rules = rules_for(mode, 7)
    assert isinstance(rules, ClientAckRules)
    held = []
    seen = 0
    for name, arg in ops:
        if name == "deliver":
            seen += 1
            held.append(rules.delivered(f"t{seen}"))
        elif name == "ack" and held:
            delivery = held[int(arg) % len(held)]
            current = set(rules.unacknowledged)
            was_dirty = rules.dirty
            decision = rules.acknowledge(delivery)
            if decision.action is AckAction.SEND:
                assert not was_dirty
                assert not rules.is_stale(delivery)
                assert set(decision.tags) <= current
            if was_dirty:
                assert decision.action is AckAction.RAISE and not rules.dirty
        elif name == "recover":
            rules.recover()
            assert not rules.dirty and rules.unacknowledged == ()
        elif name == "failover":
            before = rules.unacknowledged
            outcome = rules.failover(reattached=bool(arg))
            if arg:
                assert rules.unacknowledged == before
            else:
                assert outcome.stale == before and rules.unacknowledged == ()
                assert outcome.dirty == rules.dirty


def test_session_acknowledge_covers_every_delivery_in_both_client_modes() -> None:
    for mode in (AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL):
        rules = rules_for(mode, 1)
        for tag in ("a", "b", "c"):
            rules.delivered(tag)
        decision = rules.acknowledge_all()
        assert decision.action is AckAction.SEND
        assert sorted(decision.tags) == ["a", "b", "c"], mode
        assert rules.acknowledge_all().action is AckAction.NOTHING  # nothing left
