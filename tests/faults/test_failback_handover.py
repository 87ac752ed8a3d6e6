"""A failback hand-over whose last frame is lost (found by the nemesis, issue 18).

Failback: the preferred live, restarted, joins the acting live as backup, synchronizes, and
asks for the role back. The acting live stops serving, claims the next activation for it in
the pair directory (Witness.hand_over), and then tells it so with HANDOVER_READY. Here that
frame is lost: the acting live's packets to the preferred live are dropped from the instant
the preferred live is synchronized (the acting live is held with SIGSTOP for the few
milliseconds it takes to put the rule in place, well under the heart-beat timeout).

What should happen: the claim names the preferred live, which is "ours to serve, with or
without HANDOVER_READY", so the preferred live serves and the pair has exactly one live.

What happened before the fix (reference_broker/node.py): _watch_link gave the link up as
"live silent past the heartbeat timeout" before it looked at the witness; _take_over then saw
the activation moved on ("the role moved on; staying backup") and _may_start_live refused
because this node never recorded the handed activation as served. The acting live, having
handed the role away, stayed backup too. No node served, and healing the network changed
nothing. Now _take_over reads the claim first (Node._handed_to_us).
"""

from __future__ import annotations

import time

import pytest

from reference_broker import BrokerPair

from .netns import Network

pytestmark = pytest.mark.timeout(120)


def test_a_lost_handover_ready_still_leaves_a_live(
    fault_pair: BrokerPair, network: Network
) -> None:
    preferred, acting = fault_pair.nodes
    fault_pair.kill(preferred)
    deadline = time.monotonic() + 20
    while acting.role != "live":
        assert time.monotonic() < deadline, "the backup did not take over"
        time.sleep(0.01)
    fault_pair.restart(preferred)
    deadline = time.monotonic() + 30
    while not preferred.status().get("synchronized"):
        assert time.monotonic() < deadline, "the restarted node did not synchronize"
        time.sleep(0.002)
    fault_pair.pause(acting)
    try:
        network.block("backup", "live")
    finally:
        fault_pair.resume(acting)
    time.sleep(2.0)
    network.heal()
    deadline = time.monotonic() + 10
    while not any(node.role == "live" for node in fault_pair.nodes):
        roles = [(n.name, n.status().get("role"), n.status().get("activation")) for n in
                 fault_pair.nodes]  # fmt: skip
        assert time.monotonic() < deadline, f"no node serves after the hand-over: {roles}"
        time.sleep(0.05)
    # The claim names the preferred live: it serves, and the pair settles with one live.
    assert preferred.role == "live", "the node the role was handed to does not serve"
    settle = time.monotonic() + 2.0
    while time.monotonic() < settle:
        live = [node.name for node in fault_pair.nodes if node.role == "live"]
        assert live == [preferred.name], f"the pair should have exactly one live: {live}"
        time.sleep(0.05)
