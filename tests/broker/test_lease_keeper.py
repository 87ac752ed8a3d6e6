"""LeaseKeeper: the live's lease renewed on a thread of its own, while the loop is alive.

A real Node and Witness in a temporary pair directory; the event loop is blocked with
time.sleep, as CPU-bound work on it would block it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from reference_broker.node import LeaseKeeper, Node, NodeConfig
from reference_broker.witness import Outcome

pytestmark = pytest.mark.timeout(60)


def live_node(tmp_path: Path) -> Node:
    node = Node(
        NodeConfig(
            node_id="live", role="live", data_dir=tmp_path / "data", pair_dir=tmp_path / "pair"
        )
    )
    decision = node.witness.try_activate("live", ["127.0.0.1:61613"])
    assert decision.outcome is Outcome.ACTIVATED and decision.lease is not None
    node.lease = decision.lease
    node.activation = decision.lease.activation
    return node


def run_blocked(node: Node, seconds: float) -> LeaseKeeper:
    """Start a keeper, then block the event loop for ``seconds``."""

    async def main() -> LeaseKeeper:
        keeper = LeaseKeeper(node)
        keeper.start()
        await asyncio.sleep(0.1)
        time.sleep(seconds)  # the loop does nothing else meanwhile
        keeper.stop(keep_lease=True)
        return keeper

    return asyncio.run(main())


def test_a_loop_starved_for_longer_than_the_lease_keeps_it(tmp_path: Path) -> None:
    node = live_node(tmp_path)
    lease = node.config.lease
    keeper = run_blocked(node, 1.5 * lease)  # would have fenced the live before
    assert node.lease is not None and node.lease.may_serve(time.monotonic())
    assert keeper.renewals >= 2
    assert keeper.max_gap < lease - node.config.timing.margin


def test_a_hung_loop_lets_the_lease_run_out(tmp_path: Path) -> None:
    node = live_node(tmp_path)
    lease = node.config.lease
    # Renewals stop 2 leases after the loop's last beat; the last lease ends one lease later.
    keeper = run_blocked(node, 2 * lease + lease + 0.5)
    assert node.lease is not None and not node.lease.may_serve(time.monotonic())
    assert keeper.renewals <= 2 * lease / node.config.timing.renew_interval + 1


def test_stop_drops_the_lease_and_no_renewal_brings_it_back(tmp_path: Path) -> None:
    node = live_node(tmp_path)

    async def main() -> int:
        keeper = LeaseKeeper(node)
        keeper.start()
        await asyncio.sleep(0.1)
        keeper.stop()
        assert node.lease is None
        renewals = keeper.renewals
        await asyncio.sleep(node.config.timing.renew_interval * 2)
        assert node.lease is None
        return keeper.renewals - renewals

    assert asyncio.run(main()) == 0
