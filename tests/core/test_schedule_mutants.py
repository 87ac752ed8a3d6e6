"""The reconnect schedule's edges that mutation testing found unguarded (docs/testing.md).

Each test names the behaviour it pins; the mutants it kills are noted in docs/testing.md.
"""

from __future__ import annotations

import random
from collections.abc import MutableSequence
from typing import Any

import pytest

from hafailover.core.schedule import Attempt, AttemptsExhausted, ReconnectSchedule
from hafailover.errors import SecurityError
from hafailover.url import BrokerAddress, parse_url
from tests.core.test_schedule import at_most


class Extremes(random.Random):
    """A random source that always draws the low end of a range (or the high end), and
    shuffles by reversing: what the schedule does with each draw can then be checked."""

    def __init__(self, *, high: bool = False) -> None:
        super().__init__(0)
        self.high = high
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.ranges.append((a, b))
        return b if self.high else a

    def shuffle(self, x: MutableSequence[Any]) -> None:
        x.reverse()


def hosts(attempts: list[Attempt]) -> list[str]:
    return [a.broker.host for a in attempts]


def test_the_jitter_spreads_a_wait_by_its_fraction_both_ways() -> None:
    url = "stomp://a?retry_interval=1s&retry_interval_multiplier=2&retry_jitter=0.5"
    low = Extremes()
    assert ReconnectSchedule(parse_url(url), rng=low).delay_before(3) == pytest.approx(1.0)
    assert low.ranges == [(-0.5, 0.5)]  # drawn from -jitter to +jitter
    high = ReconnectSchedule(parse_url(url), rng=Extremes(high=True))
    assert high.delay_before(3) == pytest.approx(3.0)


def test_a_schedule_without_a_random_source_makes_its_own() -> None:
    s = ReconnectSchedule(parse_url("stomp://a?retry_interval=1s&retry_jitter=0.5"))
    assert 0.5 <= s.delay_before(2) <= 1.5
    assert next(s.rotation.order(initial=False)).host == "a"


def test_singlebroker_keeps_every_first_connection_attempt_on_the_first_broker() -> None:
    s = ReconnectSchedule(
        parse_url(
            "failover:(stomp://a,stomp://b)?failover_method=singlebroker&initial_connect_attempts=3"
        ),
        rng=Extremes(),
    )
    assert hosts(s.plan(initial=True, limit=3)) == ["a", "a", "a"]


def test_random_order_comes_from_the_random_source() -> None:
    s = ReconnectSchedule(
        parse_url("failover:(stomp://a,stomp://b,stomp://c)?failover_method=random"),
        rng=Extremes(),
    )
    assert hosts(s.plan(initial=False, limit=6)) == ["c", "b", "a", "c", "b", "a"]


def test_the_first_connection_walks_the_list_in_order_even_with_random() -> None:
    """F12: initial_connect_attempts walk the URL's list from its first broker."""
    s = ReconnectSchedule(
        parse_url(
            "failover:(stomp://a,stomp://b,stomp://c)?failover_method=random"
            "&initial_connect_attempts=3"
        ),
        rng=Extremes(),
    )
    tried: list[str] = []

    def refuse(broker: BrokerAddress, attempt: int) -> None:
        tried.append(broker.host)
        raise ConnectionRefusedError(broker.host)

    with pytest.raises(AttemptsExhausted):
        s.run(refuse, initial=True, sleep=at_most(100), cancelled=lambda: False)
    assert tried == ["a", "b", "c"]


def test_a_reconnect_from_a_broker_no_longer_announced_starts_at_the_first() -> None:
    s = ReconnectSchedule(parse_url("stomp://live"), rng=Extremes())
    s.rotation.learn_topology([("live", 61613), ("backup", 61700)])
    s.rotation.connected_to(s.rotation.brokers[1])
    s.rotation.learn_topology([("other", 61800)])  # the backup is not announced any more
    assert hosts(s.plan(initial=False, limit=3)) == ["live", "other", "live"]


def test_each_failed_attempt_is_reported_with_its_error() -> None:
    s = ReconnectSchedule(parse_url("stomp://a?reconnect_attempts=2"), rng=Extremes())
    errors = [OSError("first"), OSError("second")]
    heard: list[tuple[int, BaseException]] = []

    def refuse(broker: BrokerAddress, attempt: int) -> None:
        raise errors[attempt - 1]

    with pytest.raises(AttemptsExhausted) as caught:
        s.run(
            refuse,
            initial=False,
            sleep=at_most(100),
            cancelled=lambda: False,
            on_failure=lambda a, e: heard.append((a.number, e)),
        )
    assert heard == [(1, errors[0]), (2, errors[1])]
    assert caught.value.last_error is errors[1]


def test_exhaustion_says_how_many_attempts_and_the_last_error() -> None:
    error = ConnectionRefusedError("refused")
    assert str(AttemptsExhausted(3, error)) == f"gave up after 3 attempt(s): {error!r}"


def test_attempts_stop_at_their_limit_for_the_first_connection_and_a_reconnect() -> None:
    s = ReconnectSchedule(
        parse_url("failover:(stomp://a,stomp://b)?initial_connect_attempts=2&reconnect_attempts=3"),
        rng=Extremes(),
    )
    for initial, allowed in ((True, 2), (False, 3)):
        calls: list[int] = []

        def refuse(broker: BrokerAddress, attempt: int, calls: list[int] = calls) -> None:
            calls.append(attempt)
            if attempt > 10:  # a schedule that does not stop: fail now rather than hang
                raise SecurityError("runaway schedule")
            raise ConnectionResetError(broker.host)

        with pytest.raises(AttemptsExhausted) as caught:
            s.run(refuse, initial=initial, sleep=at_most(100), cancelled=lambda: False)
        assert calls == list(range(1, allowed + 1))
        assert caught.value.attempts == allowed


def test_a_plan_numbers_its_attempts_and_keeps_the_first_connections_limit() -> None:
    s = ReconnectSchedule(
        parse_url(
            "failover:(stomp://a,stomp://b)?initial_connect_attempts=2&reconnect_attempts=-1"
        ),
        rng=Extremes(),
    )
    assert [a.number for a in s.plan(initial=True, limit=5)] == [1, 2]
    assert [a.number for a in s.plan(initial=False, limit=5)] == [1, 2, 3, 4, 5]


def test_the_known_brokers_are_the_urls_until_a_broker_announces_others() -> None:
    policy = parse_url("failover:(stomp://a,stomp://b)?failover_server_list=replace")
    assert ReconnectSchedule(policy, rng=Extremes()).rotation.brokers == policy.brokers
