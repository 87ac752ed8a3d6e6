"""A consumer closed holding messages the application had not acknowledged: the broker took
them back with the subscription. The CLIENT modes' rules forget them, so that no acknowledge
names the ended subscription: CLIENT_INDIVIDUAL refuses the acknowledge of one (it would
claim a message settled that comes again), CLIENT acknowledges what the session still holds."""

from __future__ import annotations

import pytest

from hafailover.ack_modes import AckAction, AckMode, ClientAckRules, rules_for
from hafailover.ack_modes.client import _TAKEN_BACK_KEPT
from hafailover.errors import IllegalStateError


def test_client_individual_refuses_to_acknowledge_a_message_its_closed_consumer_gave_back() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    closed, kept = rules.delivered("t1"), rules.delivered("t2")
    rules.subscription_ended(("t1",))
    assert isinstance(rules, ClientAckRules)
    assert rules.unacknowledged == ("t2",)
    with pytest.raises(IllegalStateError, match="consumer closed"):
        rules.acknowledge(closed)
    assert rules.acknowledge(closed).action is AckAction.NOTHING  # said once
    assert rules.acknowledge(kept).tags == ("t2",)
    assert rules.release(closed).action is AckAction.NOTHING


def test_client_acknowledges_what_the_session_still_holds() -> None:
    rules = rules_for(AckMode.CLIENT, 1)
    closed, _kept = rules.delivered("t1"), rules.delivered("t2")
    rules.subscription_ended(("t1",))
    decision = rules.acknowledge(closed)
    assert decision.action is AckAction.SEND and decision.tags == ("t2",)


def test_a_reconnect_or_a_recover_makes_them_stale_like_the_rest() -> None:
    for settle in ("failover", "recover"):
        rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
        closed = rules.delivered("t1")
        rules.subscription_ended(("t1",))
        if settle == "failover":
            rules.failover(reattached=False)
        else:
            rules.recover()
        assert rules.acknowledge(closed).action is AckAction.NOTHING, settle


def test_only_the_newest_are_remembered() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    tags = tuple(f"t{n}" for n in range(_TAKEN_BACK_KEPT + 1))
    deliveries = [rules.delivered(tag) for tag in tags]
    rules.subscription_ended(tags)
    assert rules.acknowledge(deliveries[0]).action is AckAction.NOTHING  # forgotten
    with pytest.raises(IllegalStateError):
        rules.acknowledge(deliveries[1])
    with pytest.raises(IllegalStateError):
        rules.acknowledge(deliveries[-1])
