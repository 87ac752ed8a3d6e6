"""The rules of named subscriptions and of the redelivery limit (core/subscriptions.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.core.subscriptions import (
    NamedSubscription,
    RedeliveryLimit,
    SubscriptionKind,
    check_can_open,
    check_can_unsubscribe,
    named_subscription,
)
from hafailover.destination import Destination
from hafailover.errors import ConfigurationError, IllegalStateError

TOPIC = Destination.topic("prices")
OTHER = Destination.topic("news")

DURABLE, SHARED, SHARED_DURABLE = (
    SubscriptionKind.DURABLE,
    SubscriptionKind.SHARED,
    SubscriptionKind.SHARED_DURABLE,
)


def test_broker_names_are_qualified_by_the_client_id_when_there_is_one() -> None:
    assert named_subscription(DURABLE, TOPIC, "ticks", "app-1").broker_name == "app-1.ticks"
    assert named_subscription(SHARED, TOPIC, "ticks", "app-1").broker_name == "app-1.ticks"
    assert named_subscription(SHARED_DURABLE, TOPIC, "ticks", None).broker_name == "ticks"


def test_a_durable_subscription_that_is_not_shared_needs_a_client_id() -> None:
    with pytest.raises(ConfigurationError, match="client_id"):
        named_subscription(DURABLE, TOPIC, "ticks", None)


@pytest.mark.parametrize("name", ["", "a b", "a|b", "a::b", "x" * 201, 7, None])
def test_a_bad_name_is_refused_by_name(name: object) -> None:
    with pytest.raises(ConfigurationError, match="subscription name"):
        named_subscription(SHARED, TOPIC, name, None)


def test_only_topics_have_subscriptions() -> None:
    with pytest.raises(ConfigurationError, match="to a topic"):
        named_subscription(SHARED, Destination.queue("orders"), "ticks", None)


def _open(
    kind: SubscriptionKind, topic: Destination = TOPIC, selector: str | None = None
) -> tuple[NamedSubscription, Destination, str | None]:
    return (NamedSubscription(kind, "ticks", "app"), topic, selector)


def test_a_subscription_that_is_not_shared_has_one_active_consumer() -> None:
    wanted = NamedSubscription(DURABLE, "ticks", "app")
    check_can_open(wanted, TOPIC, None, [])
    for kind in (DURABLE, SHARED_DURABLE):
        with pytest.raises(IllegalStateError, match="only one"):
            check_can_open(wanted, TOPIC, None, [_open(kind)])
    with pytest.raises(IllegalStateError, match="only one"):
        check_can_open(
            NamedSubscription(SHARED_DURABLE, "ticks", "app"), TOPIC, None, [_open(DURABLE)]
        )


def test_shared_consumers_must_agree_on_kind_topic_and_selector() -> None:
    wanted = NamedSubscription(SHARED_DURABLE, "ticks", "app")
    check_can_open(wanted, TOPIC, None, [_open(SHARED_DURABLE)])
    check_can_open(wanted, TOPIC, None, [(NamedSubscription(DURABLE, "other", "app"), TOPIC, None)])
    with pytest.raises(IllegalStateError, match="open as shared"):
        check_can_open(wanted, TOPIC, None, [_open(SHARED)])
    with pytest.raises(IllegalStateError, match="cannot change its topic"):
        check_can_open(wanted, TOPIC, None, [_open(SHARED_DURABLE, OTHER)])
    with pytest.raises(IllegalStateError, match="cannot change its topic"):
        check_can_open(wanted, TOPIC, None, [_open(SHARED_DURABLE, TOPIC, "a = 1")])


def test_unsubscribe_is_refused_while_a_consumer_is_open() -> None:
    assert check_can_unsubscribe("ticks", [NamedSubscription(SHARED, "ticks", None)]) == "ticks"
    with pytest.raises(IllegalStateError, match="active consumer"):
        check_can_unsubscribe("ticks", [NamedSubscription(SHARED_DURABLE, "ticks", None)])
    with pytest.raises(ConfigurationError):
        check_can_unsubscribe("", [])


def test_the_limit_counts_the_brokers_count_or_its_own_whichever_is_more() -> None:
    limit = RedeliveryLimit(2)
    assert not limit.exceeded("m", 0)
    assert not limit.exceeded("m", 2)
    assert limit.exceeded("m", 3)
    # Two failures the broker never heard of (a failover lost their give-backs):
    limit.failed("m", 0)
    limit.failed("m", 0)
    assert not limit.exceeded("m", 0)
    limit.failed("m", 1)
    assert limit.exceeded("m", 0)  # three failures: rejected on the next delivery
    assert not limit.exceeded(None, 2)


def test_no_limit_never_rejects() -> None:
    limit = RedeliveryLimit(-1)
    for _ in range(5):
        limit.failed("m", 100)
    assert not limit.exceeded("m", 10**6)


@pytest.mark.parametrize("bad", [-2, True, 1.5, "3"])
def test_a_bad_limit_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_redeliveries"):
        RedeliveryLimit(bad)  # type: ignore[arg-type]


@given(st.integers(0, 5), st.lists(st.integers(0, 8), max_size=12))
def test_a_message_is_handed_out_at_most_limit_plus_one_times(
    max_redeliveries: int, broker_counts: list[int]
) -> None:
    """Whatever counts the broker sends (a backup may send lower ones than the live did),
    a message that always fails is handed out at most max_redeliveries + 1 times."""
    limit = RedeliveryLimit(max_redeliveries, remember=4)
    handed_out = 0
    for count in [*broker_counts, *range(max_redeliveries + 2)]:
        if limit.exceeded("m", count):
            break
        handed_out += 1
        limit.failed("m", count)
    assert handed_out <= max_redeliveries + 1


def test_only_the_last_ids_are_remembered() -> None:
    limit = RedeliveryLimit(0, remember=2)
    for message_id in ("a", "b", "c"):
        limit.failed(message_id, 0)
    assert not limit.exceeded("a", 0)
    assert limit.exceeded("b", 0)
    assert limit.exceeded("c", 0)


def test_a_name_of_200_characters_using_every_allowed_one_is_accepted() -> None:
    allowed = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."
    name = (allowed * 4)[:200]
    assert named_subscription(SHARED, TOPIC, name, None).name == name
    assert named_subscription(SHARED, TOPIC, allowed, None).name == allowed


@pytest.mark.parametrize("kind", list(SubscriptionKind))
def test_the_subscription_keeps_the_kind_asked_for(kind: SubscriptionKind) -> None:
    subscription = named_subscription(kind, TOPIC, "ticks", "app")
    assert subscription == NamedSubscription(kind, "ticks", "app")
    assert subscription.durable is (kind is not SHARED)
    assert subscription.shared is (kind is not DURABLE)


def test_the_client_id_refusal_names_both_ways_out() -> None:
    with pytest.raises(ConfigurationError) as refused:
        named_subscription(DURABLE, TOPIC, "ticks", None)
    assert str(refused.value) == (
        "durable subscription 'ticks' is not shared, so it needs a client id: add "
        "client_id=<id> to the URL, or use create_shared_durable_consumer"
    )


def test_a_conflict_is_found_behind_other_subscriptions() -> None:
    """Every open subscription is checked, not only those before the first other name."""
    unrelated = (NamedSubscription(SHARED, "other", "app"), TOPIC, None)
    wanted = NamedSubscription(DURABLE, "ticks", "app")
    with pytest.raises(IllegalStateError, match="only one"):
        check_can_open(wanted, TOPIC, None, [unrelated, _open(DURABLE)])


def test_a_conflict_names_the_subscription_and_the_rule() -> None:
    wanted = NamedSubscription(DURABLE, "ticks", "app")
    with pytest.raises(IllegalStateError) as one:
        check_can_open(wanted, TOPIC, None, [_open(DURABLE)])
    assert str(one.value) == (
        "subscription 'ticks' already has an active consumer on this connection, and a "
        "subscription that is not shared may have only one"
    )
    shared = NamedSubscription(SHARED_DURABLE, "ticks", "app")
    with pytest.raises(IllegalStateError) as changed:
        check_can_open(shared, TOPIC, None, [_open(SHARED_DURABLE, OTHER)])
    assert str(changed.value) == (
        "subscription 'ticks' is open on topic://news with selector None; a shared "
        "subscription cannot change its topic or selector while it has consumers"
    )
    with pytest.raises(IllegalStateError) as unsubscribing:
        check_can_unsubscribe("ticks", [NamedSubscription(DURABLE, "ticks", "app")])
    assert str(unsubscribing.value) == (
        "durable subscription 'ticks' has an active consumer on this "
        "connection: close it before unsubscribing"
    )


def test_a_message_without_an_id_is_judged_by_the_brokers_count_alone() -> None:
    limit = RedeliveryLimit(0)
    limit.failed(None, 0)
    assert not limit.exceeded(None, 0)
    assert limit.exceeded(None, 1)


def test_the_consumer_counts_the_failures_of_its_last_10000_message_ids() -> None:
    """docs/client.md, poison messages: "per message id (its last 10,000)"."""
    limit = RedeliveryLimit(0)
    for number in range(10_001):
        limit.failed(str(number), 0)
    assert not limit.exceeded("0", 0)  # the oldest is forgotten
    assert limit.exceeded("1", 0)
