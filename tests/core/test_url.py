"""The connection URL: parsing, round trip, and rejection with clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.errors import ConfigurationError, InvalidURLError
from hafailover.url import BrokerAddress, FailoverMethod, FailoverPolicy, Protocol, parse_url
from tests.strategies import policies


def test_failover_url_with_every_option() -> None:
    policy = parse_url(
        "failover:(stomp://app:s%3Acret@live.example:61613,stomp+ssl://[::1])"
        "?failover_method=random&reconnect_attempts=5&initial_connect_attempts=3"
        "&retry_interval=250ms&retry_interval_multiplier=2.0&max_retry_interval=10s"
        "&retry_jitter=0.2&confirmation_window_size=64KiB&heartbeat=500ms"
        "&connection_ttl=30s&call_timeout=5s&call_failover_timeout=-1"
        "&use_topology=false&duplicate_detection=no"
    )
    live, backup = policy.brokers
    assert live == BrokerAddress("stomp", "live.example", 61613, "app", "s:cret")
    assert backup == BrokerAddress("stomp+ssl", "::1", 61614)
    assert backup.tls and not live.tls
    assert policy.protocol is Protocol.STOMP
    assert policy.failover_method is FailoverMethod.RANDOM
    assert policy.reconnect_attempts == 5
    assert policy.initial_connect_attempts == 3
    assert policy.retry_interval == 0.25
    assert policy.retry_interval_multiplier == 2.0
    assert policy.max_retry_interval == 10.0
    assert policy.retry_jitter == 0.2
    assert policy.confirmation_window_size == 64 * 1024
    assert policy.heartbeat == 0.5
    assert policy.connection_ttl == 30.0
    assert policy.call_timeout == 5.0
    assert policy.call_failover_timeout is None
    assert policy.use_topology is False
    assert policy.duplicate_detection is False


def test_single_url_defaults() -> None:
    policy = parse_url("amqp://localhost")
    assert policy.brokers == (BrokerAddress("amqp", "localhost", 5672),)
    assert policy == FailoverPolicy(brokers=(BrokerAddress("amqp", "localhost", 5672),))
    assert policy.reattach_enabled
    assert policy.effective_reconnect_attempts == -1
    assert str(policy) == "amqp://localhost:5672"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("100ms", 0.1), ("2s", 2.0), ("1.5s", 1.5), ("250", 0.25), ("1m", 60.0), ("1h", 3600.0)],
)
def test_duration_units(text: str, seconds: float) -> None:
    assert parse_url(f"stomp://h?call_timeout={text}").call_timeout == seconds


@pytest.mark.parametrize(
    ("text", "size"),
    [("1MiB", 1 << 20), ("64KiB", 65536), ("1000", 1000), ("2KB", 2000), ("1GiB", 1 << 30)],
)
def test_size_units(text: str, size: int) -> None:
    assert parse_url(f"stomp://h?confirmation_window_size={text}").confirmation_window_size == size


def test_window_minus_one_disables_reattach() -> None:
    policy = parse_url("stomp://h?confirmation_window_size=-1")
    assert policy.confirmation_window_size == -1
    assert not policy.reattach_enabled


def test_alias_client_failure_check_period() -> None:
    assert parse_url("stomp://h?client_failure_check_period=250ms").heartbeat == 0.25
    with pytest.raises(InvalidURLError, match="given twice"):
        parse_url("stomp://h?client_failure_check_period=250ms&heartbeat=1s")


def test_nofailover_means_no_reconnect() -> None:
    policy = parse_url("failover:(stomp://a,stomp://b)?failover_method=nofailover")
    assert policy.effective_reconnect_attempts == 0


def test_credentials_argument_fills_missing_users_only() -> None:
    policy = parse_url("failover:(stomp://a,stomp://bob:pw@b)").with_credentials("amy", "x")
    assert [(b.user, b.password) for b in policy.brokers] == [("amy", "x"), ("bob", "pw")]


def test_redacted_hides_passwords() -> None:
    policy = parse_url("failover:(stomp://u:secret@a,stomp://u:secret@b)")
    assert "secret" not in policy.redacted()
    assert "secret" not in repr(policy)
    assert policy.redacted().count("***") == 2


@pytest.mark.parametrize(
    ("url", "option", "fragment"),
    [
        ("failover:(stomp://a,amqp://b)", "brokers", "mixes protocols"),
        ("failover:()", "brokers", "names no broker"),
        ("failover:stomp://a", "brokers", "parentheses"),
        ("failover:(stomp://a", "brokers", "not closed"),
        ("failover:(stomp://a)junk", "brokers", "unexpected text"),
        ("failover:(stomp://a,stomp://a)", "brokers", "listed twice"),
        ("failover:(stomp://a?heartbeat=1s)", "heartbeat", "inside the failover list"),
        ("http://a", "scheme", "unknown scheme"),
        ("stomp:/a", "scheme", "unknown scheme"),
        ("stomp://a:0", "port", "out of range"),
        ("stomp://a:70000", "port", "out of range"),
        ("stomp://a:http", "port", "not a number"),
        ("stomp://:61613", "host", "names no host"),
        ("stomp://[::1", "host", "unclosed"),
        ("stomp://a/queue", "path", "takes no path"),
        ("stomp://a?colour=red", "colour", "unknown option"),
        ("stomp://a?heartbeat", "heartbeat", "has no value"),
        ("stomp://a?retry_interval=fast", "retry_interval", "bad value"),
        ("stomp://a?retry_interval=0", "retry_interval", "more than zero"),
        ("stomp://a?retry_interval=5parsecs", "retry_interval", "unknown duration unit"),
        ("stomp://a?reconnect_attempts=-2", "reconnect_attempts", "below -1"),
        ("stomp://a?reconnect_attempts=many", "reconnect_attempts", "bad value"),
        ("stomp://a?initial_connect_attempts=0", "initial_connect_attempts", "never connect"),
        ("stomp://a?retry_interval_multiplier=0.5", "retry_interval_multiplier", "outside"),
        ("stomp://a?retry_jitter=2", "retry_jitter", "outside"),
        ("stomp://a?confirmation_window_size=0", "confirmation_window_size", "positive"),
        ("stomp://a?confirmation_window_size=1.5B", "confirmation_window_size", "whole"),
        ("stomp://a?use_topology=maybe", "use_topology", "not a boolean"),
        ("stomp://a?failover_method=closest", "failover_method", "bad value"),
        ("stomp://a?retry_interval=5s&max_retry_interval=1s", "max_retry_interval", "shorter"),
        ("stomp://a?heartbeat=10s&connection_ttl=1s", "connection_ttl", "shorter"),
        (
            "stomp://a?failover_method=nofailover&reconnect_attempts=3",
            "reconnect_attempts",
            "contradicts",
        ),
    ],
)
def test_bad_urls_name_the_option(url: str, option: str, fragment: str) -> None:
    with pytest.raises(InvalidURLError, match=fragment) as caught:
        parse_url(url)
    assert caught.value.option == option
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, ConfigurationError)


def test_bad_value_lists_accepted_values() -> None:
    with pytest.raises(InvalidURLError) as caught:
        parse_url("stomp://a?failover_method=closest")
    assert "roundrobin, singlebroker, random, nofailover" in str(caught.value)
    assert "roundrobin" in caught.value.accepted


def test_policy_built_in_code_is_validated() -> None:
    broker = BrokerAddress("stomp", "a", 61613)
    with pytest.raises(InvalidURLError, match="retry_jitter"):
        FailoverPolicy(brokers=(broker,), retry_jitter=1.5)
    with pytest.raises(InvalidURLError, match="port"):
        BrokerAddress("stomp", "a", 0)
    with pytest.raises(ValueError, match="scheme"):
        BrokerAddress("gopher", "a", 70)


def test_non_string_url() -> None:
    with pytest.raises(InvalidURLError, match="must be a string"):
        parse_url(b"stomp://a")  # type: ignore[arg-type]


@given(policies())
def test_str_round_trips(policy: FailoverPolicy) -> None:
    assert parse_url(policy.unredacted()) == policy


@given(policies())
def test_redacted_parses_to_the_same_shape(policy: FailoverPolicy) -> None:
    redacted = parse_url(policy.redacted())
    assert [b.endpoint for b in redacted.brokers] == [b.endpoint for b in policy.brokers]
    assert redacted.options() == policy.options()


@given(st.text(max_size=80))
def test_arbitrary_text_parses_or_raises_invalid_url(text: str) -> None:
    try:
        policy = parse_url(text)
    except InvalidURLError:
        return
    assert parse_url(policy.unredacted()) == policy


@given(policies(), st.sampled_from(["colour", "retries", "heart_beat"]), st.text(max_size=5))
def test_unknown_option_always_rejected(policy: FailoverPolicy, name: str, value: str) -> None:
    separator = "&" if "?" in str(policy) else "?"
    with pytest.raises(InvalidURLError) as caught:
        parse_url(f"{policy}{separator}{name}=x{value}")
    assert caught.value.option == name


def test_f12_a_client_that_may_start_after_a_failover_walks_the_brokers_at_once() -> None:
    """The Spark sink's workers: the first connection fails over like a reconnect unless
    the URL says how many attempts it gets; the URL's word is read from what it named,
    not from its text."""
    url = "failover:(stomp://live:61613,stomp://backup:61613)?reconnect_attempts=7"
    policy = parse_url(url)
    assert policy.given == frozenset({"reconnect_attempts"})
    assert policy.first_connection_fails_over().initial_connect_attempts == 7
    named = parse_url(url + "&initial_connect_attempts=1")
    assert named.first_connection_fails_over().initial_connect_attempts == 1
    forever = parse_url("failover:(stomp://a:1,stomp://b:2)")
    assert forever.first_connection_fails_over().initial_connect_attempts == -1
    # A password that spells the option's name is not the option.
    tricky = parse_url("stomp://u:initial_connect_attempts@live:61613?reconnect_attempts=5")
    assert tricky.first_connection_fails_over().initial_connect_attempts == 5
