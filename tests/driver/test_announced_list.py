"""failover_server_list=replace through the driver: the list a broker announces is read
relative to the broker the connection is on now, not the one it failed over from."""

from __future__ import annotations

import pytest

import hafailover

from .fake import FakeBroker, link_factory
from .test_failover_driver import Heard, failed_over, lose, url, wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_list_announced_after_a_failover_starts_with_the_broker_now_current(
    broker: FakeBroker,
) -> None:
    broker.topology = (("live", 61613), ("third", 61613))
    with hafailover.connect(
        url(failover_server_list="replace"),
        exception_listener=Heard(),
        link_factory=link_factory(broker),
    ) as connection:
        rotation = connection._schedule.rotation  # type: ignore[attr-defined]
        assert [b.host for b in rotation.brokers] == ["live", "third"]
        with broker.paused():
            broker.answers.extend(["refuse", "fresh"])  # live refuses; third (next) opens
            lose(broker.current(), "reader")
        wait_until(failed_over(connection), "the failover")
        assert "@third:" in (connection.broker or "")
        assert [b.host for b in rotation.brokers] == ["third", "live"]
