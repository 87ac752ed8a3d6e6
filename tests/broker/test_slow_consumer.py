"""A consumer that does not read cannot grow the broker's memory: once its connection's write
buffer passes the high-water mark (4 MiB) its consumers are paused, so what it has not taken
stays in the queue instead of piling up in the broker's buffers, and nothing is lost."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from proton import Endpoint, Link

from hafailover.protocols.stomp.frame import Frame, Heartbeat
from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker.stomp_wire import WireClient
from tests.broker.test_amqp_server import RawClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

MiB = 1024 * 1024
COUNT = 40_000
BODY = 2048  # 80 MB in all; one dispatch turn (1,000 deliveries) is 2 MB
# The high-water mark, one dispatch turn and the allocator's slack: far below the 80 MB the
# broker would hold in its buffers if it wrote everything to a reader that does not read.
GROWTH_BOUND = 24 * MiB


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    # Idle timeouts long enough for the raw AMQP client, which keeps nothing alive while it
    # decodes 80 MB on a busy machine.
    with BrokerPair(
        tmp_path_factory.mktemp("slow") / "pair", start_backup=False, heartbeat_timeout=10.0
    ) as pair:
        yield pair.live


def test_a_subscriber_that_does_not_read_holds_the_broker_at_its_high_water_mark(
    live: NodeProcess,
) -> None:
    destination = f"/queue/slow-{uuid.uuid4().hex[:8]}"
    producer = WireClient(live.stomp_port, timeout=60)
    assert producer.connect().command == "CONNECTED"
    for n in range(COUNT):
        body = str(n).encode().ljust(BODY, b".")
        producer.send("SEND", {"destination": destination}, body)
    producer.send("SEND", {"destination": destination, "receipt": "all"}, b"last")
    assert producer.receive(60).get("receipt-id") == "all"
    producer.close()
    time.sleep(0.5)
    before = rss(live.pid)

    reader = WireClient(live.stomp_port, timeout=60)
    reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        assert reader.connect().command == "CONNECTED"
        reader.send("SUBSCRIBE", {"id": "s", "destination": destination, "ack": "auto"})
        # It reads nothing for a while: the broker writes until its buffer is full, pauses.
        peak = before
        for _ in range(20):
            time.sleep(0.1)
            peak = max(peak, rss(live.pid))
        grown = peak - before
        print(f"slow consumer: broker RSS grew {grown / MiB:.1f} MiB over {before / MiB:.0f}")
        assert grown <= GROWTH_BOUND, f"broker RSS grew {grown / MiB:.1f} MiB"
        # Then it reads: every message comes, in order, none lost.
        seen = 0
        deadline = time.monotonic() + 120
        while seen <= COUNT and time.monotonic() < deadline:
            data = reader.sock.recv(1 << 20)
            assert data, "the broker closed the slow consumer"
            for event in reader.parser.feed(data):
                if isinstance(event, Heartbeat):
                    continue
                assert isinstance(event, Frame) and event.command == "MESSAGE", event
                expected = b"last" if seen == COUNT else str(seen).encode().ljust(BODY, b".")
                assert event.body == expected, (seen, event.body[:20])
                seen += 1
        assert seen == COUNT + 1
    finally:
        reader.close()


def test_an_amqp_receiver_that_does_not_read_holds_the_broker_at_its_high_water_mark(
    live: NodeProcess,
) -> None:
    """AMQP: a receiver that granted credit for everything and then reads nothing (its link
    pre-settled, so no window stops the broker either) is held at the same mark."""
    address = f"queue://slow-amqp-{uuid.uuid4().hex[:8]}"
    fill(live, "/queue/" + address.removeprefix("queue://"))
    time.sleep(0.5)
    before = rss(live.pid)
    client = RawClient(live.amqp_port)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        client.pump(lambda: bool(client.connection.state & Endpoint.REMOTE_ACTIVE))
        receiver = client.session.receiver(f"slow-{uuid.uuid4()}")
        receiver.source.address = address
        receiver.snd_settle_mode = Link.SND_SETTLED
        client.open_link(receiver)
        receiver.flow(COUNT + 1)
        client.pump(lambda: True)  # the flow frame goes out; then nothing is read
        # Long enough for the broker, without the pause, to write far past the bound
        # (AMQP deliveries cost it more than STOMP's).
        peak = before
        for _ in range(80):
            time.sleep(0.1)
            peak = max(peak, rss(live.pid))
            # It still writes its keep-alives, or the broker would end it for silence.
            client.transport.tick(time.monotonic())
            client._write()
        grown = peak - before
        print(f"slow AMQP receiver: broker RSS grew {grown / MiB:.1f} MiB over {before / MiB:.0f}")
        assert grown <= GROWTH_BOUND, f"broker RSS grew {grown / MiB:.1f} MiB"
        # Then it reads: every message comes, in order, none lost.
        client.pump(lambda: len(client.received.get(receiver, ())) > COUNT, timeout=120)
        bodies = [message.body for _, message in client.received[receiver]]
        assert bodies[-1] == b"last"
        assert bodies[:-1] == [str(n).encode().ljust(BODY, b".") for n in range(COUNT)]
    finally:
        client.close()


def fill(live: NodeProcess, destination: str) -> None:
    """COUNT numbered messages of BODY bytes, then b"last", waiting in ``destination``."""
    producer = WireClient(live.stomp_port, timeout=60)
    assert producer.connect().command == "CONNECTED"
    for n in range(COUNT):
        body = str(n).encode().ljust(BODY, b".")
        producer.send("SEND", {"destination": destination}, body)
    producer.send("SEND", {"destination": destination, "receipt": "all"}, b"last")
    assert producer.receive(60).get("receipt-id") == "all"
    producer.close()
