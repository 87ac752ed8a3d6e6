"""Acknowledge-mode rules that mutation testing found unguarded (docs/testing.md)."""

from __future__ import annotations

import pytest

from hafailover.ack_modes import (
    PIPELINED_ACKS,
    AckAction,
    AckMode,
    FailoverOutcome,
    LinkReliability,
    TransactedAckRules,
    check_link_reliability,
    rules_for,
)
from hafailover.errors import ConfigurationError, ErrorCode, IllegalStateError

NOT_TRANSACTED = [m for m in AckMode if m is not AckMode.SESSION_TRANSACTED]


@pytest.mark.parametrize("mode", NOT_TRANSACTED)
def test_a_second_reconnect_makes_the_first_ones_deliveries_stale_too(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    rules.failover(reattached=False)
    delivery = rules.delivered("m1")
    assert not rules.is_stale(delivery)
    outcome = rules.failover(reattached=False)
    assert rules.is_stale(delivery)
    assert outcome.discard_prefetched


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK, AckMode.NO_ACKNOWLEDGE])
def test_a_reconnect_leaves_no_stale_delivery_where_the_application_never_acknowledges(
    mode: AckMode,
) -> None:
    rules = rules_for(mode, 1)
    rules.delivered("m1")
    assert rules.failover(reattached=False).stale == ()


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL])
def test_f8_an_acknowledge_sends_what_it_covers_once(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    delivery = rules.delivered("m1")
    decision = rules.acknowledge(delivery)
    assert decision.action is AckAction.SEND and decision.tags == ("m1",)
    # Already acknowledged: nothing left to send.
    assert rules.acknowledge(delivery).action is AckAction.NOTHING


@pytest.mark.parametrize("mode", [AckMode.AUTO, AckMode.DUPS_OK, AckMode.NO_ACKNOWLEDGE])
def test_acknowledge_is_a_no_op_where_the_application_does_not_acknowledge(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    assert rules.acknowledge(rules.delivered("m1")).action is AckAction.NOTHING


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.NO_ACKNOWLEDGE])
def test_nothing_is_acknowledged_automatically_where_the_mode_does_not(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    assert rules.after_delivery(rules.delivered("m1")).action is AckAction.NOTHING
    assert rules.acknowledge_not_sent().action is AckAction.NOTHING
    assert not rules.redelivery_expected("s", "m1")


def test_f6_recover_in_auto_has_nothing_to_give_back() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    rules.delivered("m1")
    assert rules.recover().redeliver == ()


def test_f6_exactly_the_bound_of_expected_redeliveries_is_kept() -> None:
    rules = rules_for(AckMode.AUTO, 1)
    bound = 4 * PIPELINED_ACKS
    lost = []
    for serial in range(bound + 1):  # the last one handed out is not expected again
        rules.delivered(f"t{serial}")
        lost.append(("s", f"t{serial}", f"m{serial}"))
    outcome = rules.failover(reattached=False, lost_acks=tuple(lost))
    assert len(outcome.expect_again) == bound
    assert rules.redelivery_expected("s", "m0")  # the oldest still fits


def test_f14_the_errors_say_what_to_use_instead() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r": a no-ack session never acknowledges \(use unreliable or at-most-once\)$",
    ):
        check_link_reliability(AckMode.NO_ACKNOWLEDGE, LinkReliability.AT_LEAST_ONCE)
    with pytest.raises(
        ConfigurationError,
        match=r": the session acknowledges, so the link must be at-least-once or exactly-once$",
    ):
        check_link_reliability(AckMode.CLIENT, LinkReliability.AT_MOST_ONCE)


def _transacted_with_a_delivery() -> tuple[TransactedAckRules, object]:
    rules = rules_for(AckMode.SESSION_TRANSACTED, 1)
    assert isinstance(rules, TransactedAckRules)
    delivery = rules.delivered("m1")
    assert delivery.tag == "m1"
    return rules, delivery


def test_f9_a_reattach_that_lost_work_dooms_the_transaction_but_keeps_the_session() -> None:
    rules, delivery = _transacted_with_a_delivery()
    outcome = rules.failover(reattached=True, lost_work=True)
    assert outcome.dirty and rules.transaction.rollback_only
    assert not outcome.discard_prefetched  # the server kept the session and its prefetch
    assert not rules.is_stale(delivery)  # type: ignore[arg-type]
    assert outcome.stale == ("m1",)


def test_f9_a_reconnect_of_a_clean_transacted_session_still_starts_a_new_generation() -> None:
    rules, delivery = _transacted_with_a_delivery()
    rules.transaction.begin_commit()
    rules.transaction.commit_finished()
    rules.transaction_ended()
    outcome = rules.failover(reattached=False)
    assert not outcome.dirty
    assert outcome.discard_prefetched
    assert rules.is_stale(delivery)  # type: ignore[arg-type]
    later = rules.delivered("m2")
    rules.transaction.rollback()
    rules.transaction_ended()
    rules.failover(reattached=False)
    assert rules.is_stale(later)


def test_f9_a_reattach_tells_the_transaction_the_server_never_got_the_commit() -> None:
    rules, _ = _transacted_with_a_delivery()
    rules.transaction.begin_commit()
    rules.transaction.commit_written()
    rules.failover(reattached=True, commit_received=False)
    fate = rules.transaction.commit_fate()
    assert fate is not None and fate.code is ErrorCode.TRANSACTION_ROLLED_BACK


# --- the capabilities and decisions the driver now asks for ---


@pytest.mark.parametrize("mode", [AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL])
def test_session_acknowledge_of_a_dirty_session_with_nothing_new_raises_and_cleans(
    mode: AckMode,
) -> None:
    rules = rules_for(mode, 1)
    rules.delivered("m0")
    rules.failover(reattached=False)
    decision = rules.acknowledge_all()
    assert decision.action is AckAction.RAISE
    assert decision.code is ErrorCode.ACKNOWLEDGE_STALE
    assert decision.redeliver == () and not decision.recover
    assert rules.acknowledge_all().action is AckAction.NOTHING


def test_the_implicit_recover_names_what_it_gives_back() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    rules.delivered("m0")
    rules.failover(reattached=False)
    rules.delivered("n1")
    last = rules.delivered("n2")
    decision = rules.acknowledge(last)
    assert decision.recover and decision.redeliver == ("n1", "n2")


@pytest.mark.parametrize("mode", [AckMode.NO_ACKNOWLEDGE, AckMode.SESSION_TRANSACTED])
def test_the_base_rules_answer_for_modes_that_do_not_override_them(mode: AckMode) -> None:
    rules = rules_for(mode, 1)
    assert not rules.prefetched_stale(rules.generation)
    generation = rules.generation
    rules.failover(reattached=False)
    assert rules.prefetched_stale(generation)
    with pytest.raises(IllegalStateError, match="acknowledge\\(\\) is for CLIENT"):
        rules.acknowledge_all()
    assert rules.ack_failed(ErrorCode.UNBLOCKED, last=True).action is AckAction.NOTHING
    assert rules.confirm_first(last_pipelined=False, last_done=False, in_flight=0).value == ("none")


def test_the_capabilities_of_each_mode() -> None:
    confirms = {m for m in AckMode if rules_for(m, 1).confirms_acknowledges}
    by_application = {m for m in AckMode if rules_for(m, 1).acknowledged_by_application}
    acknowledged = {m for m in AckMode if rules_for(m, 1).acknowledges_deliveries}
    transacted = {m for m in AckMode if rules_for(m, 1).transaction is not None}
    assert confirms == {AckMode.AUTO}
    assert by_application == {AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL}
    assert acknowledged == set(AckMode) - {AckMode.NO_ACKNOWLEDGE}
    assert transacted == {AckMode.SESSION_TRANSACTED}


# --- found by the third round (docs/testing.md) ---


def test_client_a_message_its_closed_consumer_gave_back_is_acknowledged_once() -> None:
    # The first acknowledge of it covers what the session held; a second is an acknowledge
    # of a message acknowledged already, which does nothing (it must not cover later ones).
    rules = rules_for(AckMode.CLIENT, 1)
    closed = rules.delivered("t1")
    rules.delivered("t2")
    rules.subscription_ended(("t1",))
    assert rules.acknowledge(closed).tags == ("t2",)
    rules.delivered("t3")
    assert rules.acknowledge(closed).action is AckAction.NOTHING
    assert rules.acknowledge_all().tags == ("t3",)


def test_client_individual_says_in_full_why_it_refuses_a_message_given_back() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    closed = rules.delivered("t1")
    rules.subscription_ended(("t1",))
    with pytest.raises(IllegalStateError) as refused:
        rules.acknowledge(closed)
    assert str(refused.value) == (
        "this message's consumer closed before the message was acknowledged: the broker "
        "took it back and delivers it again (acknowledge before closing the consumer)"
    )


def test_a_failover_that_costs_a_session_nothing_reports_plain_false() -> None:
    # The outcome goes into the FailoverReport the application reads (SessionFailover.dirty):
    # False, not merely something false.
    transacted, _ = _transacted_with_a_delivery()
    kept = FailoverOutcome(stale=(), dirty=False, discard_prefetched=False)
    outcome = transacted.failover(reattached=True)
    assert outcome == kept
    assert outcome.dirty is False and outcome.discard_prefetched is False
    assert rules_for(AckMode.NO_ACKNOWLEDGE, 1).failover(reattached=False).dirty is False
    assert rules_for(AckMode.AUTO, 1).failover(reattached=True) == kept
