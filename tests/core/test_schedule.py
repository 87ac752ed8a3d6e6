"""The reconnect schedule: backoff, attempt limits, broker order, topology, cancellation."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.core.schedule import AttemptsExhausted, ReconnectCancelled, ReconnectSchedule
from hafailover.errors import (
    ConfigurationError,
    ConnectionClosedError,
    IllegalStateError,
    SecurityError,
)
from hafailover.url import BrokerAddress, FailoverPolicy, parse_url
from tests.strategies import policies


def schedule(url: str, seed: int = 0) -> ReconnectSchedule:
    return ReconnectSchedule(parse_url(url), rng=random.Random(seed))


def hosts(attempts: list[BrokerAddress]) -> list[str]:
    return [b.host for b in attempts]


def at_most(attempts: int) -> Callable[[float], None]:
    """A sleep for ``run()`` that fails the test once the schedule goes on past
    ``attempts`` attempts: a schedule that never stops fails the test at once instead of
    hanging it (run() sleeps before every attempt after the first, even for 0 s)."""
    made = itertools.count(2)

    def sleep(seconds: float) -> None:
        if next(made) > attempts:
            raise AssertionError(f"the schedule went on past {attempts} attempts")

    return sleep


def test_artemis_backoff_formula_without_jitter() -> None:
    s = schedule(
        "stomp://a?retry_interval=1s&retry_interval_multiplier=2&max_retry_interval=5s"
        "&retry_jitter=0"
    )
    assert [s.delay_before(n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


@given(policies(), st.integers(1, 60), st.integers(0, 2**32))
def test_jitter_stays_within_its_spread(policy: FailoverPolicy, attempt: int, seed: int) -> None:
    jittered = ReconnectSchedule(policy, rng=random.Random(seed)).delay_before(attempt)
    if attempt == 1:
        assert jittered == 0.0
        return
    base = min(
        policy.retry_interval * policy.retry_interval_multiplier ** (attempt - 2),
        policy.max_retry_interval,
    )
    spread = base * policy.retry_jitter
    assert base - spread - 1e-9 <= jittered <= base + spread + 1e-9


def test_roundrobin_starts_at_the_current_broker_and_cycles() -> None:
    s = schedule("failover:(stomp://a,stomp://b,stomp://c)")
    assert hosts([a.broker for a in s.plan(initial=False, limit=5)]) == ["a", "b", "c", "a", "b"]
    s.rotation.connected_to(s.policy.brokers[1])
    assert hosts([a.broker for a in s.plan(initial=False, limit=4)]) == ["b", "c", "a", "b"]


def test_singlebroker_stays_on_the_current_broker() -> None:
    s = schedule("failover:(stomp://a,stomp://b)?failover_method=singlebroker")
    s.rotation.connected_to(s.policy.brokers[1])
    assert hosts([a.broker for a in s.plan(initial=False, limit=3)]) == ["b", "b", "b"]
    assert hosts([a.broker for a in s.plan(initial=True, limit=1)]) == ["a"]


def test_random_visits_every_broker_once_per_pass() -> None:
    s = schedule("failover:(stomp://a,stomp://b,stomp://c)?failover_method=random", seed=3)
    order = hosts([a.broker for a in s.plan(initial=False, limit=9)])
    for start in (0, 3, 6):
        assert sorted(order[start : start + 3]) == ["a", "b", "c"]


def test_nofailover_makes_no_reconnect_attempt() -> None:
    s = schedule("failover:(stomp://a,stomp://b)?failover_method=nofailover")
    assert s.plan(initial=False, limit=5) == []
    with pytest.raises(AttemptsExhausted) as caught:
        s.run(lambda b, n: b, initial=False, sleep=at_most(100), cancelled=lambda: False)
    assert caught.value.attempts == 0


def test_initial_connection_tries_only_the_first_broker_by_default() -> None:
    """F12: failing over to a backup needs one successful connection first."""
    s = schedule("failover:(stomp://live,stomp://backup)")
    tried: list[str] = []

    def refuse(broker: BrokerAddress, attempt: int) -> None:
        tried.append(broker.host)
        raise ConnectionRefusedError(broker.host)

    with pytest.raises(AttemptsExhausted) as caught:
        s.run(refuse, initial=True, sleep=at_most(100), cancelled=lambda: False)
    assert tried == ["live"]
    assert isinstance(caught.value.last_error, ConnectionRefusedError)


def test_initial_connect_attempts_allow_walking_the_list() -> None:
    s = schedule("failover:(stomp://live,stomp://backup)?initial_connect_attempts=3")
    tried: list[str] = []

    def backup_only(broker: BrokerAddress, attempt: int) -> str:
        tried.append(broker.host)
        if broker.host != "backup":
            raise ConnectionRefusedError(broker.host)
        return "connected"

    assert s.run(backup_only, initial=True, sleep=at_most(100), cancelled=lambda: False) == (
        "connected"
    )
    assert tried == ["live", "backup"]
    assert s.rotation.current.host == "backup"


def test_run_sleeps_by_the_schedule_and_reports_failures() -> None:
    s = schedule(
        "failover:(stomp://a,stomp://b)?reconnect_attempts=4&retry_interval=100ms"
        "&retry_interval_multiplier=2&retry_jitter=0"
    )
    slept: list[float] = []
    failures: list[tuple[int, str, float]] = []

    def fail_three(broker: BrokerAddress, attempt: int) -> int:
        if attempt < 4:
            raise OSError(f"attempt {attempt}")
        return attempt

    result = s.run(
        fail_three,
        initial=False,
        sleep=slept.append,
        cancelled=lambda: False,
        on_failure=lambda a, e: failures.append((a.number, a.broker.host, a.delay)),
    )
    assert result == 4
    assert slept == [0.1, 0.2, 0.4]
    assert failures == [(1, "a", 0.0), (2, "b", 0.1), (3, "a", 0.2)]
    assert s.rotation.current.host == "b"


def test_exhaustion_after_reconnect_attempts() -> None:
    s = schedule("stomp://a?reconnect_attempts=3")
    calls: list[int] = []

    def refuse(broker: BrokerAddress, attempt: int) -> None:
        calls.append(attempt)
        raise ConnectionResetError

    with pytest.raises(AttemptsExhausted) as caught:
        s.run(refuse, initial=False, sleep=at_most(100), cancelled=lambda: False)
    assert calls == [1, 2, 3]
    assert caught.value.attempts == 3


def test_forever_keeps_going_until_cancelled() -> None:
    s = schedule("stomp://a?reconnect_attempts=-1")
    calls: list[int] = []

    def refuse(broker: BrokerAddress, attempt: int) -> None:
        calls.append(attempt)
        raise ConnectionResetError

    with pytest.raises(ReconnectCancelled):
        s.run(refuse, initial=False, sleep=at_most(100), cancelled=lambda: len(calls) >= 50)
    assert len(calls) == 50


def test_errors_a_retry_cannot_fix_propagate_at_once() -> None:
    s = schedule("stomp://a?reconnect_attempts=10")
    for error in (SecurityError("bad password"), ConfigurationError("bad")):
        calls: list[int] = []

        def refuse(
            broker: BrokerAddress, attempt: int, error: Exception = error, calls: list[int] = calls
        ) -> None:
            calls.append(attempt)
            raise error

        with pytest.raises(type(error)):
            s.run(refuse, initial=False, sleep=at_most(100), cancelled=lambda: False)
        assert calls == [1]


def test_any_other_failure_of_an_attempt_is_retried() -> None:
    """An attempt that meets a local error (an illegal state while connecting, the AMQP
    reader-thread guard, a bug) is one failed attempt: ending reconnection on it would
    leave a connection that could come back for good without one (issue 17)."""
    s = schedule("stomp://a?reconnect_attempts=-1")
    for error in (
        IllegalStateError("waiting on the reader thread would deadlock"),
        ConnectionClosedError("closed"),
        RuntimeError("a bug"),
    ):
        calls: list[int] = []

        def fail_twice(
            broker: BrokerAddress, attempt: int, error: Exception = error, calls: list[int] = calls
        ) -> str:
            calls.append(attempt)
            if attempt <= 2:
                raise error
            return "connected"

        assert (
            s.run(fail_twice, initial=False, sleep=at_most(100), cancelled=lambda: False)
            == "connected"
        )
        assert calls == [1, 2, 3]


def test_topology_adds_announced_brokers_with_current_credentials() -> None:
    s = schedule("stomp://u:p@live:61613")
    assert s.rotation.learn_topology([("live", 61613), ("backup", 61700)])
    assert [(b.host, b.port, b.user, b.password) for b in s.rotation.brokers] == [
        ("live", 61613, "u", "p"),
        ("backup", 61700, "u", "p"),
    ]
    assert not s.rotation.learn_topology([("live", 61613), ("backup", 61700)])
    assert hosts([a.broker for a in s.plan(initial=False, limit=3)]) == ["live", "backup", "live"]
    # A later announcement replaces what was learned; the URL's brokers stay.
    assert s.rotation.learn_topology([("other", 1)])
    assert hosts(list(s.rotation.brokers)) == ["live", "other"]


def test_topology_ignored_when_disabled() -> None:
    s = schedule("stomp://live?use_topology=false")
    assert not s.rotation.learn_topology([("backup", 61700)])
    assert len(s.rotation.brokers) == 1


@given(policies(), st.integers(1, 30))
def test_plan_never_exceeds_the_allowed_attempts(policy: FailoverPolicy, limit: int) -> None:
    s = ReconnectSchedule(policy, rng=random.Random(0))
    for initial in (True, False):
        allowed = s.attempts_allowed(initial=initial)
        planned = s.plan(initial=initial, limit=limit)
        assert len(planned) == (limit if allowed == -1 else min(limit, allowed))
        assert all(a.broker in s.rotation.brokers for a in planned)
        assert [a.number for a in planned] == list(range(1, len(planned) + 1))
