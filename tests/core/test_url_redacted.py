"""Addresses and URLs print with their passwords hidden, however they are printed.

Issue 19: ``str(BrokerAddress)`` printed the password, so one f-string in a log line leaked
it. ``str()``, ``format()`` and ``%s`` now give the redacted form; ``unredacted()`` is the one
way to the whole URL, and it still parses back to an equal policy.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.url import BrokerAddress, parse_url

PASSWORD = "s3cr3t-pa55"
URL = f"failover:(stomp://app:{PASSWORD}@h1:61613,stomp://app:{PASSWORD}@h2:61613)?retry_jitter=0"


def test_an_address_prints_without_its_password() -> None:
    broker = BrokerAddress("stomp", "h1", 61613, "app", PASSWORD)
    for text in (str(broker), f"{broker}", "%s" % broker, format(broker), repr(broker)):  # noqa: UP031
        assert PASSWORD not in text, text
    assert str(broker) == "stomp://app:***@h1:61613" == broker.redacted()
    assert broker.unredacted() == f"stomp://app:{PASSWORD}@h1:61613"


def test_a_policy_prints_without_its_passwords(caplog: pytest.LogCaptureFixture) -> None:
    policy = parse_url(URL)
    for text in (str(policy), f"{policy}", repr(policy), str(policy.brokers)):
        assert PASSWORD not in text, text
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("connecting with %s to %s", policy, policy.brokers[0])
    assert PASSWORD not in caplog.text
    assert str(policy) == policy.redacted()
    assert parse_url(policy.unredacted()) == policy


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789!$&'()*+,;=", min_size=1))
def test_no_password_survives_str(password: str) -> None:
    marker = f"PW{password}PW"  # never a part of the rest of the URL
    policy = parse_url(f"amqp://user:{marker}@broker:5672")
    assert marker not in str(policy)
    assert marker not in str(policy.brokers[0])
    assert policy.brokers[0].password == marker
    assert parse_url(policy.unredacted()) == policy
