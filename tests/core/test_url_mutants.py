"""The URL grammar's edges that mutation testing found unguarded (docs/testing.md).

Each test names the behaviour it pins; the mutants it kills are noted in docs/testing.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hafailover.errors import InvalidURLError
from hafailover.url import BrokerAddress, FailoverPolicy, Protocol, parse_url


def _rejected(url: str) -> InvalidURLError:
    with pytest.raises(InvalidURLError) as caught:
        parse_url(url)
    return caught.value


def test_the_highest_port_is_accepted_and_the_next_is_not() -> None:
    assert parse_url("stomp://h:65535").brokers[0].port == 65535
    error = _rejected("stomp://h:65536")
    assert error.option == "port"
    assert error.accepted == ("1-65535",)
    assert "port 65536 is out of range" in str(error)


def test_an_ipv6_host_is_bracketed_when_rendered() -> None:
    address = BrokerAddress("stomp", "::1", 61613)
    assert address.unredacted() == "stomp://[::1]:61613"
    assert str(address) == "stomp://[::1]:61613"
    assert BrokerAddress("stomp", "h", 1).unredacted() == "stomp://h:1"


def test_a_slash_in_user_or_password_is_escaped() -> None:
    address = BrokerAddress("stomp", "h", 1, "a/b", "c/d")
    assert address.unredacted() == "stomp://a%2Fb:c%2Fd@h:1"
    assert address.redacted() == "stomp://a%2Fb:***@h:1"
    assert parse_url(address.unredacted()).brokers == (address,)


def test_an_ipv6_host_takes_a_port_after_its_bracket() -> None:
    assert parse_url("stomp://[::1]:61615").brokers[0] == BrokerAddress("stomp", "::1", 61615)
    assert parse_url("stomp://[::1]").brokers[0].port == 61613


def test_text_between_an_ipv6_bracket_and_the_port_is_rejected() -> None:
    for url in ("stomp://[::1]x:61613", "stomp://[::1]x]:61613", "stomp://[::1]]"):
        error = _rejected(url)
        assert error.option == "host"
        assert error.accepted == ("[::1]:61613",)
        assert "unexpected text after the IPv6 host" in str(error)


def test_an_unclosed_ipv6_bracket_names_the_accepted_form() -> None:
    error = _rejected("stomp://[::1:61613")
    assert error.option == "host"
    assert error.accepted == ("[::1]:61613",)
    assert "unclosed '['" in str(error)


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("initial_connect_attempts=0", "0 would never connect"),
        ("retry_interval=0", "it must be more than zero"),
        ("confirmation_window_size=0", "it must be -1 (off) or a positive size"),
    ],
)
def test_a_rejected_value_says_why(query: str, reason: str) -> None:
    error = _rejected(f"stomp://h?{query}")
    assert f"({reason})" in str(error)


def test_a_one_byte_window_is_a_window() -> None:
    policy = parse_url("stomp://h?confirmation_window_size=1")
    assert policy.confirmation_window_size == 1
    assert policy.reattach_enabled


@pytest.mark.parametrize("url", ["stomp://fe80::1", "stomp://::1:61613", "stomp://a:b:61613"])
def test_an_ipv6_host_without_brackets_is_rejected(url: str) -> None:
    # Before, "stomp://fe80::1" parsed quietly as host "fe80:" and port 1.
    error = _rejected(url)
    assert error.option == "host"
    assert error.accepted == ("[::1]:61613",)
    assert "an IPv6 host must be in brackets" in str(error)


def test_a_missing_host_and_a_bad_port_name_the_accepted_form() -> None:
    error = _rejected("stomp://:61613")
    assert (error.option, error.accepted) == ("host", ("host:port",))
    error = _rejected("stomp://h:x")
    assert (error.option, error.accepted) == ("port", ("1-65535",))
    assert "port 'x' is not a number" in str(error)


def test_an_unknown_scheme_and_a_path_name_the_accepted_forms() -> None:
    error = _rejected("ftp://h")
    assert (error.option, error.accepted) == ("scheme", ("stomp", "stomp+ssl", "amqp", "amqps"))
    error = _rejected("amqp://h/vhost")
    assert (error.option, error.accepted) == ("path", ("amqp://host:port",))


def test_the_scheme_is_the_text_before_the_first_separator() -> None:
    error = _rejected("stomp://h?heartbeat=x://y")
    assert error.option == "heartbeat"


def test_an_at_sign_in_the_password_belongs_to_the_password() -> None:
    address = parse_url("stomp://u:p@ss@h").brokers[0]
    assert (address.user, address.password, address.host) == ("u", "p@ss", "h")


def test_a_colon_in_the_password_belongs_to_the_password() -> None:
    address = parse_url("stomp://u:p:w@h").brokers[0]
    assert (address.user, address.password) == ("u", "p:w")


def test_a_user_without_a_colon_has_no_password() -> None:
    address = parse_url("stomp://u@h").brokers[0]
    assert (address.user, address.password) == ("u", None)
    assert parse_url("stomp://u:@h").brokers[0].password == ""


def test_a_host_error_quotes_the_url() -> None:
    assert "'stomp://:61613' names no host" in str(_rejected("stomp://:61613"))


def test_an_empty_pair_in_the_query_is_skipped_not_the_end() -> None:
    policy = parse_url("stomp://h?heartbeat=2s&&call_timeout=3s&")
    assert (policy.heartbeat, policy.call_timeout) == (2.0, 3.0)


def test_an_unknown_option_lists_every_name_and_alias() -> None:
    error = _rejected("stomp://h?nope=1")
    assert error.option == "nope"
    assert "heartbeat" in error.accepted
    assert "client_failure_check_period" in error.accepted
    assert list(error.accepted) == sorted(error.accepted)


def test_an_option_given_twice_is_named() -> None:
    error = _rejected("stomp://h?heartbeat=1s&client_failure_check_period=2s")
    assert (error.option, error.accepted) == ("heartbeat", ("each option once",))
    assert "option 'heartbeat' is given twice" in str(error)


@pytest.mark.parametrize("query", ["heartbeat=", "heartbeat=%20", "heartbeat"])
def test_an_option_without_a_value_says_so(query: str) -> None:
    error = _rejected(f"stomp://h?{query}")
    assert error.option == "heartbeat"
    assert "option 'heartbeat' has no value" in str(error)


_B = (BrokerAddress("stomp", "h", 61613),)
_TLS = (BrokerAddress("stomp+ssl", "h", 61614),)


def _refused(**fields: object) -> InvalidURLError:
    brokers = fields.pop("brokers", _B)
    with pytest.raises(InvalidURLError) as caught:
        FailoverPolicy(brokers=brokers, **fields)  # type: ignore[arg-type]
    return caught.value


def test_a_negative_dedup_and_a_missing_file_say_why(tmp_path: Path) -> None:
    assert "(-2 is negative)" in str(_rejected("stomp://h?consumer_dedup=-2"))
    missing = tmp_path / "nothing.pem"
    error = _rejected(f"stomp+ssl://h?ssl_ca_file={missing}")
    assert f"(no such file: {missing})" in str(error)


def test_a_file_option_takes_a_file_that_exists(tmp_path: Path) -> None:
    pem = tmp_path / "ca.pem"
    pem.write_text("x")
    assert parse_url(f"stomp+ssl://h?ssl_ca_file={pem}").ssl_ca_file == str(pem)
    assert parse_url(f"stomp+ssl://h?ssl_ca_file=%20{pem}%20").ssl_ca_file == str(pem)
    assert _rejected(f"stomp+ssl://h?ssl_ca_file={tmp_path}").option == "ssl_ca_file"


def test_the_broker_list_errors_are_exact() -> None:
    error = _refused(brokers=())
    assert str(error) == "the failover list names no broker (accepted: stomp://host:port)"
    assert error.option == "brokers"
    error = _rejected("failover:(stomp://h:1,amqp://h:2)")
    assert str(error) == (
        "a failover list mixes protocols (amqp, stomp); every broker must speak the same one"
        " (accepted: all stomp:// and stomp+ssl://, all amqp:// and amqps://)"
    )
    error = _rejected("failover:(stomp://a:1,stomp://a:1)")
    assert str(error) == "broker a:1 is listed twice (accepted: each broker once)"


def test_a_field_built_in_code_is_checked_by_its_option() -> None:
    error = _refused(retry_jitter=2.0)
    assert (error.option, error.accepted) == ("retry_jitter", ("a fraction from 0.0 to 1.0",))
    # a value whose rendering fails (None where a duration is due) is invalid too
    assert _refused(heartbeat=None).option == "heartbeat"


def test_max_retry_interval_may_equal_retry_interval() -> None:
    policy = parse_url("stomp://h?retry_interval=2s&max_retry_interval=2s")
    assert policy.max_retry_interval == policy.retry_interval == 2.0
    error = _rejected("stomp://h?retry_interval=2s&max_retry_interval=1s")
    assert (error.option, error.accepted) == ("max_retry_interval", (">= 2s",))


def test_connection_ttl_against_the_heartbeat() -> None:
    policy = parse_url("stomp://h?heartbeat=1s&connection_ttl=1s")
    assert policy.connection_ttl == policy.heartbeat == 1.0
    error = _rejected("stomp://h?heartbeat=500ms&connection_ttl=200ms")
    assert error.option == "connection_ttl"
    assert error.accepted == (">= 500ms", "-1")
    assert str(error).startswith(
        "connection_ttl=200ms is shorter than heartbeat=500ms: the broker would drop "
        "sessions before a heartbeat could keep them"
    )


def test_a_tls_option_on_a_plain_broker_is_named() -> None:
    error = _rejected("stomp://h?ssl_verify=false")
    assert str(error) == (
        "ssl_verify is for TLS brokers, and none of these is (accepted: stomp+ssl://, amqps://)"
    )
    assert error.option == "ssl_verify"
    assert parse_url("stomp+ssl://h?ssl_verify=false").ssl_verify is False


@pytest.mark.parametrize(("given", "missing"), [("cert", "ssl_key_file"), ("key", "ssl_cert_file")])
def test_mutual_tls_names_the_missing_half(tmp_path: Path, given: str, missing: str) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    error = _refused(brokers=_TLS, **{f"ssl_{given}_file": str(pem)})
    assert str(error) == (
        f"mutual TLS needs both ssl_cert_file and ssl_key_file; {missing} is missing"
        " (accepted: the path of a PEM file)"
    )
    assert error.option == missing


def test_f12_with_no_reconnect_attempts_still_connects_once() -> None:
    policy = parse_url("stomp://h?reconnect_attempts=0").first_connection_fails_over()
    assert policy.initial_connect_attempts == 1


def test_an_option_without_a_value_lists_what_it_takes() -> None:
    assert _rejected("stomp://h?reconnect_attempts=").accepted == (
        "-1 (forever)",
        "0",
        "a positive count",
    )


def test_a_url_that_is_not_a_string_is_named() -> None:
    with pytest.raises(InvalidURLError) as caught:
        parse_url(5)  # type: ignore[arg-type]
    assert str(caught.value) == "a URL must be a string, not int (accepted: str)"
    assert caught.value.option == "url"


def test_a_failover_list_error_shows_the_accepted_form() -> None:
    form = ("failover:(stomp://h1:61613,stomp://h2:61613)",)
    assert _rejected("failover:stomp://h").accepted == form
    assert _rejected("failover:(stomp://h").accepted == form


def test_the_broker_list_ends_at_the_first_parenthesis() -> None:
    assert "bad value for heartbeat" in str(_rejected("failover:(stomp://h)?heartbeat=(2s)"))


def test_credentials_fill_in_whichever_half_is_given() -> None:
    policy = parse_url("failover:(stomp://a:1,stomp://b:2)")
    assert policy.with_credentials(None, None) is policy
    assert policy.with_credentials("u", None).brokers[0] == BrokerAddress("stomp", "a", 1, "u")
    filled = policy.with_credentials(None, "p").brokers[1]
    assert (filled.user, filled.password) == (None, "p")


def test_text_after_the_broker_list_is_named() -> None:
    error = _rejected("failover:(stomp://h)x")
    assert (error.option, error.accepted) == ("brokers", ("?option=value&...",))


def test_an_empty_entry_in_the_broker_list_is_skipped_not_the_end() -> None:
    policy = parse_url("failover:(stomp://a:1,,stomp://b:2)")
    assert [b.host for b in policy.brokers] == ["a", "b"]


def test_options_inside_the_broker_list_are_refused_by_name() -> None:
    error = _rejected("failover:(stomp://h?heartbeat=1s&call_timeout=2s)")
    assert error.option == "heartbeat"
    assert str(error) == (
        "broker stomp://h:61613 carries options inside the failover list; put them after the "
        "closing parenthesis (accepted: failover:(...)?option=value)"
    )


def test_nofailover_with_reconnect_attempts_lists_the_ways_out() -> None:
    error = _rejected("stomp://h?failover_method=nofailover&reconnect_attempts=3")
    assert error.accepted == ("0 with nofailover", "another failover_method")


def test_a_policy_renders_its_options_joined_and_escaped(tmp_path: Path) -> None:
    policy = parse_url("failover:(stomp://a:1,stomp://b:2)?heartbeat=2s&call_timeout=3s")
    assert policy.unredacted() == (
        "failover:(stomp://a:1,stomp://b:2)?heartbeat=2s&call_timeout=3s"
    )
    pem = tmp_path / "ca.pem"
    pem.write_text("x")
    tls = parse_url(f"stomp+ssl://h?ssl_ca_file={pem}")
    assert tls.unredacted() == f"stomp+ssl://h:61614?ssl_ca_file={str(pem).replace('/', '%2F')}"


def test_the_float_ranges_include_their_ends() -> None:
    # _parse_float_range runs at import: its mutants are checked by hand (docs/testing.md).
    assert parse_url("stomp://h?retry_interval_multiplier=1.0").retry_interval_multiplier == 1.0
    assert parse_url("stomp://h?retry_interval_multiplier=100").retry_interval_multiplier == 100.0
    assert parse_url("stomp://h?retry_jitter=0").retry_jitter == 0.0
    assert parse_url("stomp://h?retry_jitter=1").retry_jitter == 1.0
    assert "(1.5 is outside 0..1)" in str(_rejected("stomp://h?retry_jitter=1.5"))
    assert "(0.5 is outside 1..100)" in str(_rejected("stomp://h?retry_interval_multiplier=0.5"))


@pytest.mark.parametrize(
    ("scheme", "protocol", "tls", "port"),
    [
        ("stomp", Protocol.STOMP, False, 61613),
        ("stomp+ssl", Protocol.STOMP, True, 61614),
        ("amqp", Protocol.AMQP, False, 5672),
        ("amqps", Protocol.AMQP, True, 5671),
    ],
)
def test_each_scheme_names_its_protocol_tls_and_default_port(
    scheme: str, protocol: Protocol, tls: bool, port: int
) -> None:
    """A single broker's URL: the policy's protocol is its one broker's; the default port
    is what an address named without one (a redirect without a port) gets."""
    policy = parse_url(f"{scheme}://h")
    broker = policy.brokers[0]
    assert (policy.protocol, broker.protocol, broker.tls) == (protocol, protocol, tls)
    assert broker.port == broker.default_port == port


def test_a_client_id_of_200_characters_is_accepted_and_a_bad_one_named() -> None:
    client_id = ("a-_" * 67)[:200]
    assert parse_url(f"stomp://h?client_id={client_id}").client_id == client_id
    error = _rejected("stomp://h?client_id=a+b")
    assert error.option == "client_id"
    assert "'a+b' is not 1 to 200 letters, digits, '-' or '_'" in str(error)


def test_a_redelivery_limit_below_minus_one_is_named() -> None:
    error = _rejected("stomp://h?max_redeliveries=-2")
    assert error.option == "max_redeliveries"
    assert "(-2 is below -1)" in str(error)


def test_the_dedup_file_needs_an_existing_directory_and_is_no_directory(tmp_path: Path) -> None:
    path = tmp_path / "window"
    policy = parse_url(f"stomp://h?consumer_dedup=10&consumer_dedup_file= {path} ")
    assert policy.consumer_dedup_file == str(path)
    missing = _rejected(f"stomp://h?consumer_dedup=10&consumer_dedup_file={tmp_path}/no/window")
    assert missing.option == "consumer_dedup_file"
    assert f"(no such directory: {tmp_path}/no)" in str(missing)
    directory = _rejected(f"stomp://h?consumer_dedup=10&consumer_dedup_file={tmp_path}")
    assert f"({tmp_path} is a directory)" in str(directory)


def test_a_dedup_file_needs_a_duplicate_window_to_keep(tmp_path: Path) -> None:
    error = _rejected(f"stomp://h?consumer_dedup=0&consumer_dedup_file={tmp_path}/window")
    assert (error.option, error.accepted) == (
        "consumer_dedup",
        ("a positive count of message ids with consumer_dedup_file",),
    )
    assert str(error).startswith(
        "consumer_dedup_file keeps the duplicate window, and consumer_dedup=0 has none"
    )


def test_use_topology_false_with_a_server_list_action_names_both_ways_out() -> None:
    error = _rejected("stomp://h?use_topology=false&failover_server_list=add")
    assert (error.option, error.accepted) == (
        "failover_server_list",
        ("ignore with use_topology=false", "use_topology=true"),
    )
