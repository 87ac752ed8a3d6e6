"""A failback hand-over whose last frame is lost (found by the nemesis, issue 18).

Failback: the preferred live, restarted, joins the acting live as backup, synchronizes, and
asks for the role back. The acting live stops serving, claims the next activation for it in
the pair directory (Witness.hand_over), and then tells it so with HANDOVER_READY. Here that
frame is lost: the acting live's packets to the preferred live are dropped from the instant
the preferred live is synchronized (the acting live is held with SIGSTOP for the few
milliseconds it takes to put the rule in place, well under the heart-beat timeout).

What should happen: the claim names the preferred live, which node.py's _watch_link says is
"ours to serve, with or without HANDOVER_READY", so the preferred live serves.

What happens (reference_broker/node.py, owned elsewhere): _watch_link gives the link up as
"live silent past the heartbeat timeout" before it ever looks at the witness, and returns
None; _take_over then sees the activation moved on ("the role moved on; staying backup") and
_may_start_live refuses because this node never recorded the handed activation as served.
The acting live, having handed the role away, stays backup too ("the role moved on"). No
node serves, and healing the network changes nothing: an outage until an operator steps in.
"""

from __future__ import annotations

import time

import pytest

from reference_broker import BrokerPair

from .netns import Network

pytestmark = pytest.mark.timeout(120)


@pytest.mark.xfail(
    strict=True,
    reason="reference_broker/node.py: a hand-over whose HANDOVER_READY is lost leaves no "
    "node serving (the receiver gives the silent link up before it reads the witness)",
)
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
