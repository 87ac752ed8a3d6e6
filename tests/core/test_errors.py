"""The error hierarchy: one root, a code on every class, builtins where they fit."""

from __future__ import annotations

import inspect

import pytest

from hafailover import errors
from hafailover.errors import ErrorCode, HaFailoverError, LocalError, RemoteError

ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, HaFailoverError) and cls not in (HaFailoverError, LocalError, RemoteError)
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_has_a_code_and_one_side(cls: type[HaFailoverError]) -> None:
    assert isinstance(cls.code, ErrorCode)
    assert issubclass(cls, LocalError) != issubclass(cls, RemoteError)


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ConfigurationError, ValueError),
        (errors.InvalidURLError, ValueError),
        (errors.DisconnectedError, ConnectionError),
        (errors.UnblockedError, ConnectionError),
        (errors.CallTimeoutError, TimeoutError),
        (errors.SecurityError, PermissionError),
        (errors.IllegalStateError, RuntimeError),
        (errors.MessageTooLargeError, ValueError),
        (errors.BrowserInvalidatedError, LookupError),
    ],
)
def test_builtin_bases(cls: type[HaFailoverError], builtin: type[Exception]) -> None:
    assert issubclass(cls, builtin)


def test_browser_error_never_ends_a_loop_silently() -> None:
    """F11: a StopIteration subclass would end a for loop as if the queue were empty."""
    assert not issubclass(errors.BrowserInvalidatedError, StopIteration)


def test_the_artemis_codes() -> None:
    assert errors.FailoverNotice("x", reattached=True).code is ErrorCode.FAILOVER
    assert errors.DisconnectedError.code is ErrorCode.DISCONNECT
    assert errors.UnblockedError.code is ErrorCode.UNBLOCKED
    assert errors.TransactionRolledBackError.code is ErrorCode.TRANSACTION_ROLLED_BACK
    assert errors.TransactionOutcomeUnknownError.code is ErrorCode.TRANSACTION_OUTCOME_UNKNOWN


def test_invalid_url_error_carries_option_and_accepted_values() -> None:
    error = errors.InvalidURLError("bad", option="heartbeat", accepted=["1s", "0"])
    assert error.option == "heartbeat"
    assert error.accepted == ("1s", "0")
    assert str(error) == "bad (accepted: 1s, 0)"


def test_a_broker_out_of_resources_is_still_a_protocol_error() -> None:
    """Code that caught the broker's refusal of a send as a ProtocolError still does."""
    assert issubclass(errors.BrokerResourceError, errors.ProtocolError)
    assert errors.BrokerResourceError.code is ErrorCode.RESOURCE_LIMIT
