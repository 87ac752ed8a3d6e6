"""Message.release() in the acknowledge-mode rules: CLIENT_INDIVIDUAL gives one message
back alone; a release is an acknowledge with another outcome, so a failover makes it stale
as it makes an acknowledge stale (F8); every other mode refuses it, saying what to use."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.ack_modes import AckAction, AckMode, ClientAckRules, rules_for
from hafailover.errors import ErrorCode, IllegalStateError


def test_release_gives_one_message_back_alone() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    first, second, third = (rules.delivered(t) for t in ("t1", "t2", "t3"))
    decision = rules.release(second)
    assert decision.action is AckAction.REDELIVER and decision.tags == ("t2",)
    assert isinstance(rules, ClientAckRules)
    assert rules.unacknowledged == ("t1", "t3")  # the others stay the application's
    # Settled: a second release or an acknowledge of it has nothing to do.
    assert rules.release(second).action is AckAction.NOTHING
    assert rules.acknowledge(second).action is AckAction.NOTHING
    assert rules.acknowledge(third).tags == ("t3",)
    assert rules.release(first).tags == ("t1",)


def test_a_release_after_a_reconnect_is_stale_like_an_acknowledge() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    before = rules.delivered("t1")
    rules.failover(reattached=False)
    since = rules.delivered("t1")  # the new broker session may reuse the tag
    decision = rules.release(before)
    assert decision.action is AckAction.RAISE
    assert decision.code is ErrorCode.ACKNOWLEDGE_STALE
    # The session recovered: what it delivered since the failover goes back too.
    assert decision.recover and decision.redeliver == ("t1",)
    assert rules.release(since).action is AckAction.NOTHING  # recovered with the session
    # Clean again: the next delivery is released as usual.
    assert rules.release(rules.delivered("t2")).tags == ("t2",)


def test_a_release_in_a_session_clean_at_the_reconnect_names_no_old_delivery() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    old = rules.delivered("t1")
    assert rules.acknowledge(old).tags == ("t1",)
    rules.failover(reattached=False)
    rules.delivered("t1")  # another message under the same tag on the new session
    assert rules.release(old).action is AckAction.NOTHING


def test_a_reattach_keeps_what_can_be_released() -> None:
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 1)
    delivery = rules.delivered("t1")
    rules.failover(reattached=True)
    assert rules.release(delivery).tags == ("t1",)


@pytest.mark.parametrize(
    ("mode", "instead"),
    [
        (AckMode.AUTO, "listener that raises"),
        (AckMode.DUPS_OK, "listener that raises"),
        (AckMode.CLIENT, "recover()"),
        (AckMode.SESSION_TRANSACTED, "rollback()"),
        (AckMode.NO_ACKNOWLEDGE, "settled the message"),
    ],
)
def test_other_modes_refuse_a_release_and_say_what_instead(mode: AckMode, instead: str) -> None:
    rules = rules_for(mode, 1)
    delivery = rules.delivered("t1")
    with pytest.raises(IllegalStateError, match="CLIENT_INDIVIDUAL") as refused:
        rules.release(delivery)
    assert instead in str(refused.value)


def test_releasing_another_sessions_message_is_misuse() -> None:
    mine, theirs = rules_for(AckMode.CLIENT_INDIVIDUAL, 1), rules_for(AckMode.CLIENT_INDIVIDUAL, 2)
    with pytest.raises(IllegalStateError, match="session 2"):
        mine.release(theirs.delivered("t1"))


steps = st.lists(
    st.one_of(
        st.tuples(st.just("deliver"), st.integers(0, 50)),
        st.tuples(st.just("ack"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("recover"), st.just(0)),
        st.tuples(st.just("failover"), st.booleans()),
    ),
    max_size=30,
)


@given(steps)
def test_a_release_names_only_one_current_unsettled_delivery(ops: list[tuple[str, int]]) -> None:
    """Whatever happens, a release sent to the broker names exactly the one delivery it was
    asked for, current and unsettled; a dirty session's release raises and cleans it."""
    rules = rules_for(AckMode.CLIENT_INDIVIDUAL, 7)
    assert isinstance(rules, ClientAckRules)
    held = []
    for name, arg in ops:
        if name == "deliver":
            held.append(rules.delivered(f"t{len(held)}"))
        elif name in ("ack", "release") and held:
            delivery = held[arg % len(held)]
            current = set(rules.unacknowledged)
            was_dirty = rules.dirty
            call = rules.release if name == "release" else rules.acknowledge
            decision = call(delivery)
            if was_dirty:
                assert decision.action is AckAction.RAISE and not rules.dirty
                continue
            if decision.action in (AckAction.REDELIVER, AckAction.SEND):
                assert decision.tags == (delivery.tag,)
                assert delivery.tag in current and not rules.is_stale(delivery)
                assert delivery.tag not in rules.unacknowledged
            else:
                assert decision.action is AckAction.NOTHING
                assert delivery.tag not in current or rules.is_stale(delivery)
        elif name == "recover":
            rules.recover()
        elif name == "failover":
            rules.failover(reattached=bool(arg))
