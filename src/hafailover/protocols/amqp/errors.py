"""proton's exceptions and error conditions become hafailover's, here and nowhere else.

Pure: no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import proton
from proton import Condition, Delivery

from hafailover.errors import (
    BrokerResourceError,
    CallTimeoutError,
    ConfigurationError,
    HaFailoverError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    SecurityError,
)
from hafailover.protocols.amqp.codec import (
    ACCEPTED,
    MODIFIED,
    OUTCOME_NAMES,
    REJECTED,
    UNAUTHORIZED,
)

__all__ = ["map_errors"]

# What encoding a message can raise: a value AMQP cannot carry (a huge int, a lone surrogate).
ENCODING_ERRORS: Final = (
    proton.MessageException,
    proton.DataException,
    OverflowError,
    UnicodeError,
)


def translate(exc: BaseException, broker: str) -> HaFailoverError:
    if isinstance(exc, HaFailoverError):
        return exc
    if isinstance(exc, proton.SSLUnavailable):
        return ConfigurationError(f"{broker}: amqps needs a proton built with TLS: {exc}")
    if isinstance(exc, proton.SSLException):
        return ConfigurationError(f"{broker}: TLS configuration refused: {exc}")
    if isinstance(exc, ENCODING_ERRORS):
        return ConfigurationError(f"the message cannot be encoded for AMQP: {exc}")
    if isinstance(exc, proton.Timeout):
        return CallTimeoutError(f"{broker}: {exc}")
    if isinstance(exc, proton.ConnectionException | proton.TransportException | OSError):
        return NotConnectedError(f"{broker}: {exc}")
    return ProtocolError(f"{broker}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def map_errors(broker: str) -> Iterator[None]:
    try:
        yield
    except (proton.ProtonException, OSError, *ENCODING_ERRORS) as exc:
        raise translate(exc, broker) from exc


def condition_text(condition: Condition | None) -> str:
    if condition is None:
        return "no reason given"
    if condition.description:
        return f"{condition.name}: {condition.description}"
    return str(condition.name)


# Conditions that refuse a request rather than report a failure of the broker or network.
_REQUEST_REFUSED: Final = frozenset(
    {
        UNAUTHORIZED,
        "amqp:not-implemented",
        "amqp:not-allowed",
        "amqp:not-found",
        "amqp:invalid-field",
        "amqp:precondition-failed",
        "amqp:decode-error",
    }
)


def refuses_request(condition: Condition | None) -> bool:
    return condition is not None and condition.name in _REQUEST_REFUSED


# The broker lacks a resource (Artemis: an address full; the bundled broker: its disk full).
RESOURCE_LIMIT_EXCEEDED: Final = "amqp:resource-limit-exceeded"


def condition_error(condition: Condition | None, what: str) -> RemoteError:
    """A request the broker refused, as our error."""
    if condition is not None and condition.name == UNAUTHORIZED:
        return SecurityError(f"{what}: refused: {condition_text(condition)}")
    if condition is not None and condition.name == RESOURCE_LIMIT_EXCEEDED:
        return BrokerResourceError(f"{what}: refused: {condition_text(condition)}")
    return ProtocolError(f"{what}: refused: {condition_text(condition)}")


def refusal(condition: Condition | None, broker: str) -> RemoteError:
    """Why an open failed: a refused login, a TLS handshake that failed (a configuration
    matter: retrying cannot fix it), or no connection."""
    if condition is not None and condition.name == UNAUTHORIZED:
        return SecurityError(f"{broker} refused the login: {condition_text(condition)}")
    if condition is not None and "SSL" in (condition.description or ""):
        return SecurityError(f"TLS with {broker} failed: {condition_text(condition)}")
    return NotConnectedError(f"cannot connect to {broker}: {condition_text(condition)}")


def outcome_error(state: int, delivery: Delivery, what: str) -> ProtocolError | None:
    """None for accepted; otherwise an error naming the outcome and the broker's reason."""
    if state == ACCEPTED:
        return None
    name = OUTCOME_NAMES.get(state, f"state {state:#x}")
    detail = ""
    if state == REJECTED:
        condition = delivery.remote.condition
        detail = f": {condition_text(condition)}"
        if condition is not None and condition.name == RESOURCE_LIMIT_EXCEEDED:
            return BrokerResourceError(f"{what}: the broker {name} the message{detail}")
    elif state == MODIFIED:
        remote = delivery.remote
        detail = f" (delivery-failed={remote.failed}, undeliverable-here={remote.undeliverable})"
    return ProtocolError(f"{what}: the broker {name} the message{detail}")
