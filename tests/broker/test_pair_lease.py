"""The pair's lease against event-loop stalls: real node processes, real SIGSTOP / SIGCONT."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reference_broker.pair import BrokerPair
from tests.broker.test_pair_stomp import send_persistent

pytestmark = [pytest.mark.broker]

HEARTBEAT = 1.0


@pytest.mark.timeout(90)
def test_the_live_rides_out_stalls_like_a_full_garbage_collection(tmp_path: Path) -> None:
    """A full collection of a long backlog stops the live's event loop for 0.15-0.4 s; with
    margin to spare, five stops of 0.65 s each (SIGSTOP, shorter than the heartbeat timeout)
    must not make it miss its renewals and fence itself."""
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=HEARTBEAT) as pair:
        live = pair.live
        pid = live.pid
        for _ in range(5):
            pair.pause(live)
            time.sleep(0.65)
            pair.resume(live)
            time.sleep(0.5)
        assert live.pid == pid
        assert live.role == "live"
        assert len(send_persistent(live, "/queue/stalls", 10)) == 10
    assert "fencing itself" not in (tmp_path / "pair" / "live.log").read_text()
