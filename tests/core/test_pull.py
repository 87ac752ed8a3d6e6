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
