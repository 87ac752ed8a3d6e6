"""Fixtures of the fault scenarios: a private network per test and a broker pair on it.

``network`` is a fresh ``netns.Network`` (a router namespace with a bridge); it deletes every
namespace it made, by name, when the test ends, passed or failed. ``fault_pair`` adds the
endpoints live, backup, c0 and c1 (two client hosts) and runs a ``BrokerPair`` whose nodes sit
in the first two, with short heart-beats and lease so that a scenario stays within seconds.
Once per session, leftovers of earlier sessions (namespaces whose creating process is gone)
are swept.

The toolkit needs root, ``ip`` (iproute2) and ``iptables``; ``make test`` installs the two
packages when missing. Without them the tests skip with the reason, except in CI
(``CI=true``), where they fail.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reference_broker import BrokerPair

from .netns import NetnsError, Network, missing_tools, sweep

IN_CI = os.environ.get("CI", "").lower() == "true"

# The pair's timing in these scenarios: a live silent for HEARTBEAT_TIMEOUT is lost to its
# backup, and a takeover waits for the lease (1.5 times that) and its grace.
HEARTBEAT_TIMEOUT = 0.8


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    missing = missing_tools()
    if missing:
        return f"missing {', '.join(missing)} (make test installs iproute2 and iptables)"
    return None


def require_toolkit() -> None:
    reason = _unavailable()
    if reason is None:
        return
    message = f"the network-fault toolkit is not available: {reason}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def _sweep_leftovers() -> Iterator[None]:
    if _unavailable() is None:
        sweep()
    yield
    if _unavailable() is None:
        sweep()


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def network() -> Iterator[Network]:
    require_toolkit()
    try:
        made = Network()
    except NetnsError as exc:
        pytest.fail(f"could not build the test network: {exc}", pytrace=False)
    try:
        yield made
    finally:
        made.close()


@contextlib.contextmanager
def pair_on(network: Network, path: Path, **options: Any) -> Iterator[BrokerPair]:
    """A pair whose nodes sit in the endpoints live and backup (added here), plus client
    endpoints c0 and c1; ``options`` go to BrokerPair."""
    live, backup = network.add("live"), network.add("backup")
    network.add("c0")
    network.add("c1")
    with BrokerPair(
        path,
        user="app",
        password="secret",
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        netns={"live": live.netns, "backup": backup.netns},
        hosts={"live": live.address, "backup": backup.address},
        **options,
    ) as started:
        started.wait_synchronized(30)
        yield started


@pytest.fixture
def fault_pair(network: Network, tmp_path: Path) -> Iterator[BrokerPair]:
    with pair_on(network, tmp_path / "pair") as started:
        yield started
