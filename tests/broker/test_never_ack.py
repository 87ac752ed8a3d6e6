"""A consumer that never acknowledges: it holds its prefetch and no more, the rest wait in the
queue at a bounded cost per message, and nothing is lost when it goes. The million-message
figure is measured by benchmarks/broker.py --only-never-ack; this runs a smaller count."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafailover.protocols.stomp.frame import Frame
from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker import SHARED_NODE_LEASE
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

COUNT = 50_000
PREFETCH = 1000  # the broker's default for a client-acknowledge subscription
# Per waiting message of 100 bytes; measured about 550 (docs/broker.md).
BYTES_PER_MESSAGE = 1536


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with BrokerPair(
        tmp_path_factory.mktemp("noack") / "pair", start_backup=False, lease=SHARED_NODE_LEASE
    ) as pair:
        yield pair.live


def drain(client: WireClient, quiet: float) -> list[Frame]:
    """The MESSAGE frames that arrive until none has for ``quiet`` seconds."""
    frames = []
    while True:
        try:
            frame = client.receive(timeout=quiet)
        except TimeoutError:
            return frames
        assert frame.command == "MESSAGE", frame
        frames.append(frame)


def test_a_never_acknowledging_consumer_holds_its_prefetch_and_the_rest_wait(
    live: NodeProcess,
) -> None:
    destination = f"/queue/never-ack-{uuid.uuid4().hex[:8]}"
    hoarder = WireClient(live.stomp_port, timeout=30)
    assert hoarder.connect().command == "CONNECTED"
    hoarder.send(
        "SUBSCRIBE",
        {"id": "h", "destination": destination, "ack": "client-individual", "receipt": "s"},
    )
    assert hoarder.receive().get("receipt-id") == "s"
    before = rss(live.pid)
    producer = WireClient(live.stomp_port, timeout=60)
    assert producer.connect().command == "CONNECTED"
    for n in range(COUNT):
        producer.send("SEND", {"destination": destination}, str(n).encode().ljust(100, b"."))
    producer.send("SEND", {"destination": destination, "receipt": "all"}, b"last")
    assert producer.receive(60).get("receipt-id") == "all"
    grown = rss(live.pid) - before
    print(f"never-ack: {COUNT} waiting, live RSS grew {grown / COUNT:.0f} bytes per message")
    assert grown <= COUNT * BYTES_PER_MESSAGE, f"{grown / COUNT:.0f} bytes per waiting message"

    held = drain(hoarder, quiet=1.0)
    assert len(held) == PREFETCH  # its prefetch, no more, however long the queue
    hoarder.close()  # unacknowledged: all of it goes back to the queue

    taker = WireClient(live.stomp_port, timeout=30)
    try:
        assert taker.connect().command == "CONNECTED"
        taker.send("SUBSCRIBE", {"id": "t", "destination": destination, "ack": "auto"})
        bodies = set()
        deadline = time.monotonic() + 120
        while len(bodies) < COUNT + 1 and time.monotonic() < deadline:
            bodies.add(taker.receive(30).body)
        assert len(bodies) == COUNT + 1  # none lost
    finally:
        taker.close()
        producer.close()
