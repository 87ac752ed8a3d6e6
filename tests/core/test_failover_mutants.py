"""The failover machine's outputs that mutation testing found unguarded (docs/testing.md)."""

from __future__ import annotations

import pytest

from hafailover.core.failover import (
    CloseRequested,
    Connected,
    FailoverMachine,
    FailoverState,
    FailoverStateError,
    FailPendingCalls,
    Lost,
    Restored,
)
from hafailover.errors import ErrorCode
from hafailover.url import BrokerAddress
from tests.core.test_failover import machine_in

LIVE = BrokerAddress("stomp", "live", 61613)
BACKUP = BrokerAddress("stomp", "backup", 61613)


def _fail_codes(effects: list[object]) -> list[ErrorCode]:
    return [e.code for e in effects if isinstance(e, FailPendingCalls)]


def test_a_loss_without_reconnect_fails_the_waiting_calls_as_disconnected() -> None:
    machine = FailoverMachine(reconnect_enabled=False)
    machine.handle(Connected(LIVE, link=1))
    effects = machine.handle(Lost("reset", link=1))
    assert machine.state is FailoverState.FAILED
    assert _fail_codes(effects) == [ErrorCode.DISCONNECT]


@pytest.mark.parametrize("reconnect_enabled", [True, False])
def test_close_fails_the_waiting_calls_as_closed(reconnect_enabled: bool) -> None:
    machine = FailoverMachine(reconnect_enabled=reconnect_enabled)
    machine.handle(Connected(LIVE, link=1))
    assert _fail_codes(machine.handle(CloseRequested())) == [ErrorCode.CLOSED]


def test_every_completed_failover_is_counted() -> None:
    # The count goes into the failover report (F10, section 4 of DESIGN.md).
    machine = FailoverMachine(reconnect_enabled=True)
    machine.handle(Connected(LIVE, link=1))
    for link, broker in ((2, BACKUP), (3, LIVE), (4, BACKUP)):
        machine.handle(Lost("reset", link=link - 1))
        machine.handle(Connected(broker, resumed=False, link=link))
        machine.handle(Restored())
    assert machine.failovers_completed == 3
    assert machine.failovers_started == 3


def test_before_the_first_connection_the_machine_names_no_broker() -> None:
    # The driver's failure report reads "no broker" from None (driver/connection.py).
    assert FailoverMachine(reconnect_enabled=True).broker is None


def test_an_event_out_of_place_is_named_in_the_error() -> None:
    machine = FailoverMachine(reconnect_enabled=True)
    with pytest.raises(FailoverStateError, match=r"^Restored is not valid in state 'connecting'$"):
        machine.handle(Restored())
    assert machine.state is FailoverState.FAILED


@pytest.mark.parametrize("state", list(FailoverState))
def test_only_a_failed_or_closed_machine_is_finished(state: FailoverState) -> None:
    """The driver reads ``finished`` to know that no attempt can bring the connection back."""
    machine = machine_in(state)
    assert machine.finished is (state in (FailoverState.FAILED, FailoverState.CLOSED))
