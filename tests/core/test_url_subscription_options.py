"""The URL options of issue 21's subscriptions and poison messages: client_id and
max_redeliveries."""

from __future__ import annotations

import pytest

from hafailover.errors import InvalidURLError
from hafailover.url import parse_url


def test_client_id_and_max_redeliveries_parse_and_print_back() -> None:
    policy = parse_url("stomp://h:61613?client_id=billing-7&max_redeliveries=3")
    assert (policy.client_id, policy.max_redeliveries) == ("billing-7", 3)
    assert parse_url(policy.unredacted()) == policy
    default = parse_url("amqp://h:5672")
    assert (default.client_id, default.max_redeliveries) == (None, -1)
    assert parse_url("amqp://h:5672?max_redeliveries=0").max_redeliveries == 0


@pytest.mark.parametrize(
    ("query", "option"),
    [
        ("client_id=a.b", "client_id"),  # '.' separates it from the subscription name
        ("client_id=" + "x" * 201, "client_id"),
        ("client_id=a%20b", "client_id"),
        ("max_redeliveries=-2", "max_redeliveries"),
        ("max_redeliveries=three", "max_redeliveries"),
    ],
)
def test_a_bad_value_names_its_option(query: str, option: str) -> None:
    with pytest.raises(InvalidURLError) as caught:
        parse_url(f"stomp://h:61613?{query}")
    assert caught.value.option == option
