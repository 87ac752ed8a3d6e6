"""A rejected AMQP send becomes AddressFullError exactly when the broker says its address is
full: amqp:resource-limit-exceeded from Artemis (no code) or with the bundled pair's code
ADDRESS_FULL; the same condition for a full disk (code DISK_FULL) is the broader
BrokerResourceError, and any other rejection a plain ProtocolError."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from proton import Condition, symbol

from hafailover.errors import AddressFullError, BrokerResourceError, ProtocolError
from hafailover.protocols.amqp.codec import ACCEPTED, REJECTED
from hafailover.protocols.amqp.errors import outcome_error


def rejected(condition: Condition | None) -> Any:
    return SimpleNamespace(remote=SimpleNamespace(condition=condition))


@pytest.mark.parametrize(
    ("condition", "kind"),
    [
        (Condition("amqp:resource-limit-exceeded", "address full"), AddressFullError),
        (
            Condition(
                "amqp:resource-limit-exceeded",
                "queue://q is full",
                {symbol("hafailover-code"): "ADDRESS_FULL"},
            ),
            AddressFullError,
        ),
        (
            Condition(
                "amqp:resource-limit-exceeded",
                "the journal's disk is full",
                {symbol("hafailover-code"): "DISK_FULL"},
            ),
            BrokerResourceError,
        ),
        (Condition("amqp:invalid-field", "bad"), ProtocolError),
        (None, ProtocolError),
    ],
)
def test_a_rejection_is_address_full_only_when_the_broker_says_so(
    condition: Condition | None, kind: type[ProtocolError]
) -> None:
    error = outcome_error(REJECTED, rejected(condition), "send to queue://q")
    assert type(error) is kind
    assert str(error).startswith("send to queue://q: the broker rejected the message")
    if condition is not None:
        assert condition.name in str(error)


def test_accepted_is_no_error() -> None:
    assert outcome_error(ACCEPTED, rejected(None), "send") is None
