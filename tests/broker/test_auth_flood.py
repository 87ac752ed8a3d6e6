"""A flood of wrong-password logins against a real pair: no failover, the lease keeps its pace.

Issue 19: thirty wrong passwords used to make the live miss its lease renewals (each check is a
200,000-iteration key derivation, then computed on the event loop) and the backup take over.
Here 1,000 wrong-password logins arrive at once, half STOMP CONNECTs and half AMQP SASL PLAIN,
from 100 loopback source addresses with both a real user's name and unknown names, so that the
per-source and per-user throttles both work and many derivations really run. The live must stay
live (same process, no fencing), answer every attempt with a refusal, let a client in with the
right password afterwards, and report through its status a longest gap between two lease
renewals under ``MAX_RENEWAL_GAP``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from proton import symbol

from reference_broker.amqp.sasl import SASL_HEADER, SASL_INIT, encode_sasl_frame
from reference_broker.pair import BrokerPair
from tests.broker.stomp_wire import WireClient
from tests.broker.test_pair_stomp import send_persistent

pytestmark = [pytest.mark.broker]

HEARTBEAT = 1.0
ATTEMPTS = 1000
SOURCES = 100
# The live renews every lease / 3 = 0.5 s and may serve until lease - margin = 1.2 s after a
# renewal. The bound leaves the renewal interval plus 0.5 s for a busy machine (0.72 s was
# seen at a load of 22 on two cores), and stays below the 1.2 s past which the live would
# fence itself.
MAX_RENEWAL_GAP = 1.0


def _stomp_connect(user: str, password: str) -> bytes:
    return (
        f"CONNECT\naccept-version:1.2\nhost:localhost\nlogin:{user}\npasscode:{password}\n\n\0"
    ).encode()


def _sasl_plain(user: str, password: str) -> bytes:
    response = b"\0" + user.encode() + b"\0" + password.encode()
    return SASL_HEADER + encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), response, "localhost"])


async def _attempt(port: int, source: str, payload: bytes, refusal: bytes) -> bytes | None:
    """Send one login; None if the broker answered with ``refusal`` and closed, else what
    it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(payload)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 60)  # to the end: the broker closes
        return None if refusal in answer else answer
    finally:
        writer.close()


async def _flood(stomp_port: int, amqp_port: int) -> list[bytes | BaseException | None]:
    attempts = []
    for i in range(ATTEMPTS):
        source = f"127.0.1.{1 + i % SOURCES}"
        user = "admin" if i % 4 == 0 else f"nobody-{i}"
        if i % 2 == 0:
            payload, port, refusal = _stomp_connect(user, "wrong"), stomp_port, b"ERROR"
        else:
            # sasl-outcome (0x44) with code 1 (auth): ... 0x53 0x44 0xc0 .. 0x01 0x50 0x01
            payload, port, refusal = _sasl_plain(user, "wrong"), amqp_port, b"\x50\x01"
        attempts.append(_attempt(port, source, payload, refusal))
    return await asyncio.gather(*attempts, return_exceptions=True)


@pytest.mark.timeout(240)
def test_a_thousand_wrong_logins_at_once_cause_no_failover(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=HEARTBEAT) as pair:
        live = pair.live
        pid = live.pid
        before = live.status()
        assert "lease_renewal_max_gap" in before, before
        started = time.monotonic()
        outcomes = asyncio.run(_flood(live.stomp_port, pair.nodes[0].amqp_port))
        elapsed = time.monotonic() - started
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert not errors, errors[:5]
        unrefused = [o for o in outcomes if o is not None]
        assert not unrefused, f"{len(unrefused)} attempts not refused, e.g. {unrefused[:3]}"
        # The pair is as it was: same live process, the backup still synchronized.
        assert live.pid == pid and live.role == "live"
        pair.wait_synchronized(10)
        client = WireClient(live.stomp_port)
        assert client.connect("admin", "admin").command == "CONNECTED"
        client.sock.close()
        assert len(send_persistent(live, "/queue/after-flood", 10)) == 10
        time.sleep(0.5)  # the status is rewritten at most every 0.25 s
        status = live.status()
    log = (tmp_path / "pair" / "live.log").read_text()
    assert "fencing itself" not in log
    assert "takes over" not in (tmp_path / "pair" / "backup.log").read_text()
    gap = status["lease_renewal_max_gap"]
    print(
        f"\n{ATTEMPTS} wrong logins from {SOURCES} addresses answered in {elapsed:.1f}s; "
        f"longest lease-renewal gap {gap:.3f}s (renewal every "
        f"{status['lease_renewal_interval']:.3f}s, {status['lease_renewals']} renewals); "
        f"longest event-loop stall {status['loop_max_stall']:.3f}s"
    )
    assert status["lease_renewals"] > 0
    assert gap < MAX_RENEWAL_GAP, status
