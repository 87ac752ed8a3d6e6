"""Zero prefetch (core/pull.py): which protocol can pull, and why STOMP cannot."""

from __future__ import annotations

import pytest

from hafailover.core.pull import prefetch_refusal
from hafailover.url import Protocol


def test_amqp_pulls_and_stomp_says_why_it_cannot() -> None:
    assert prefetch_refusal(0, Protocol.AMQP) is None
    refusal = prefetch_refusal(0, Protocol.STOMP)
    assert refusal is not None
    assert "STOMP" in refusal and "prefetch=1" in refusal and "AMQP" in refusal
    assert prefetch_refusal(1, Protocol.STOMP) is None


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_what_is_no_prefetch_is_refused_by_name(bad: object) -> None:
    for protocol in Protocol:
        assert f"prefetch must be a whole number >= 0, not {bad!r}" == prefetch_refusal(
            bad, protocol
        )


def test_the_stomp_refusal_gives_the_reason_and_the_two_ways_out() -> None:
    """The whole message, as the application reads it: why STOMP cannot pull (its flow
    control), and what to use instead."""
    assert prefetch_refusal(0, Protocol.STOMP) == (
        "prefetch=0 needs a protocol in which a client asks for each message: STOMP's "
        "flow control is a window of at least one unacknowledged message the broker "
        "sends ahead (prefetch-count), with no way to ask for one or take a request "
        "back; use prefetch=1 on STOMP, or AMQP for a consumer that holds nothing"
    )
