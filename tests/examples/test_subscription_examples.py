"""The durable subscription and poison message examples, run as a user runs them."""

from __future__ import annotations

import pytest

from reference_broker.pair import BrokerPair

from .test_examples import fresh_pair, pair, run_example, run_with_kill, url_of

__all__ = ["fresh_pair", "pair"]  # the fixtures, shared with test_examples.py


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_durable_subscription_example_keeps_what_was_published_through_a_kill(
    fresh_pair: BrokerPair, protocol: str
) -> None:
    code, output = run_with_kill(
        fresh_pair,
        "durable_subscription.py",
        [url_of(fresh_pair, protocol)],
        kill_after="published 5 while the subscriber was away",
    )
    assert code == 0, output
    assert "the subscriber came back to 10" in output
    assert "failovers: 1" in output


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_poison_message_example_dead_letters_after_three_deliveries(
    pair: BrokerPair, protocol: str
) -> None:
    result = run_example("poison_message.py", url_of(pair, protocol))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "handed out 3 times, then rejected: 1" in result.stdout
    assert "in queue://DLQ: an order nobody can process" in result.stdout
