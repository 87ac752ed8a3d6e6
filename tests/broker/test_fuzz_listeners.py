"""Fuzzing every listener a node opens to the network: STOMP, AMQP and replication at once.

Each example opens several connections together, to the three ports of the live, and writes
generated frames mutated (bits flipped, bytes dropped or inserted, cut short). Throughout: the
live stays up and serves a well-formed client, its backup stays attached, and every
persistent message the well-formed client had confirmed is still there after the live is
SIGKILLed. At the end the live's RSS is within a bound of where it started. The example count
follows the Hypothesis profile: a quarter of its budget (50 under ``quick``, 500 under
HAFAILOVER_HYPOTHESIS_PROFILE=deep).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_broker.amqp.sasl import AMQP_HEADER, SASL_HEADER, SASL_INIT, encode_sasl_frame
from reference_broker.pair import BrokerPair, NodeProcess
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker, pytest.mark.timeout(900)]

MiB = 1024 * 1024
# The live's memory may grow this much over the whole run (connection buffers, caches,
# the allocator's slack); garbage kept per connection or per example would exceed it.
RSS_BOUND = 64 * MiB

CLIENT = ["CONNECT", "STOMP", "SEND", "SUBSCRIBE", "UNSUBSCRIBE", "ACK", "NACK", "BEGIN"]
CLIENT += ["COMMIT", "ABORT", "DISCONNECT"]
COMMANDS = st.sampled_from([*CLIENT, "MESSAGE", "send", "X" * 40])

# Well-formed pieces, so that frames get past the parser to the handlers; the mutations
# (and the junk commands and header names) make the malformed ones.
text = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\n\r:\x00\\"), max_size=30
)


@st.composite
def stomp_bytes(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A login kept whole (half the time), and frames to mutate after it."""
    login = b""
    if draw(st.booleans()):  # logged in, so that what follows reaches the handlers
        login = b"CONNECT\naccept-version:1.0,1.1,1.2\nlogin:admin\npasscode:admin\n\n\x00"
    frames = []
    for _ in range(draw(st.integers(1, 6))):
        command = draw(COMMANDS)
        # What most frames need (the first occurrence counts), then drawn headers.
        headers = {"destination": "/queue/fuzz", "id": "1", "message-id": "live:1"}
        headers |= draw(
            st.dictionaries(
                st.sampled_from(
                    ["accept-version", "login", "passcode", "destination", "id", "receipt",
                     "content-length", "ack", "transaction", "heart-beat", "host"]
                ) | text,
                text | st.sampled_from(["1.0", "1.2", "admin", "/queue/fuzz", "5", "-1", "0,0"]),
                max_size=5,
            )
        )  # fmt: skip
        body = b""
        if command == "SEND":
            body = draw(st.binary(max_size=200)).replace(b"\x00", b"")
        head = "\n".join([command, *(f"{k}:{v}" for k, v in headers.items())])
        frames.append(head.encode("utf-8", "surrogatepass") + b"\n\n" + body + b"\x00")
    return login, b"".join(frames)


@st.composite
def amqp_bytes(draw: st.DrawFn) -> tuple[bytes, bytes]:
    header = draw(st.sampled_from([SASL_HEADER, AMQP_HEADER, b"AMQP\x01\x01\x00\x00", b""]))
    init = encode_sasl_frame(
        SASL_INIT,
        [
            draw(st.sampled_from(["PLAIN", "ANONYMOUS", "CRAM-MD5", ""])),
            draw(st.binary(max_size=40)),
        ],
    )
    rest = draw(st.binary(max_size=300))
    if draw(st.booleans()):  # a valid login, so that what follows reaches the AMQP layer
        login = SASL_HEADER + encode_sasl_frame(SASL_INIT, ["PLAIN", b"\x00admin\x00admin"])
        return login + AMQP_HEADER, rest
    return b"", header + draw(st.sampled_from([init, b""])) + rest


@st.composite
def replication_bytes(draw: st.DrawFn) -> tuple[bytes, bytes]:
    kind = draw(st.integers(0, 20))
    hello = {
        "node_id": draw(st.sampled_from(["backup", "live", "impostor", ""])),
        "nonce": draw(st.sampled_from(["00" * 32, "zz", ""])),
    }
    payload = draw(st.sampled_from([json.dumps(hello).encode(), b""])) + draw(
        st.binary(max_size=200)
    )
    length = draw(st.sampled_from([len(payload) + 1, 0, 2**31, len(payload) + 50]))
    return b"", struct.pack("<IB", length, kind) + payload


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (operation, position, byte) edits: flip, drop, insert, cut."""
    out = bytearray(data)
    for op, at, byte in edits:
        if not out:
            break
        i = at % len(out)
        if op == 0:
            out[i] ^= byte or 1
        elif op == 1:
            del out[i]
        elif op == 2:
            out.insert(i, byte)
        else:
            del out[i:]
    return bytes(out)


edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 255)), max_size=4
)
connection_input = st.one_of(
    st.tuples(st.just("stomp"), stomp_bytes(), edits),
    st.tuples(st.just("amqp"), amqp_bytes(), edits),
    st.tuples(st.just("replication"), replication_bytes(), edits),
)


def port_of(node: NodeProcess, listener: str) -> int:
    return {
        "stomp": node.stomp_port,
        "amqp": node.amqp_port,
        "replication": node.replication_port,
    }[listener]


def hammer(port: int, data: bytes) -> None:
    """Write ``data``, read what comes back for a moment, and go."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(data)
            sock.settimeout(0.2)
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                if not sock.recv(65536):
                    break
    except OSError:
        pass  # refused, reset or silent: all fine answers to garbage


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_many_connections_of_mutated_frames_on_every_listener(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair") as pair:
        pair.wait_synchronized(30)
        live = pair.live
        destination = f"/queue/fuzz-kept-{uuid.uuid4().hex[:8]}"
        keeper = WireClient(live.stomp_port, timeout=10)
        assert keeper.connect().command == "CONNECTED"
        confirmed: list[bytes] = []
        start_rss = rss(live.pid)
        budget = max(5, settings.default.max_examples // 4)

        @settings(
            max_examples=budget,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(inputs=st.lists(connection_input, min_size=4, max_size=16))
        def one_round(
            inputs: list[tuple[str, tuple[bytes, bytes], list[tuple[int, int, int]]]],
        ) -> None:
            threads = [
                threading.Thread(target=hammer, args=(port_of(live, name), login + mutate(data, e)))
                for name, (login, data), e in inputs
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert live.running, "the live died under fuzzing"
            body = f"kept-{len(confirmed)}".encode()
            receipt = f"r{len(confirmed)}"
            keeper.send(
                "SEND",
                {"destination": destination, "persistent": "true", "receipt": receipt},
                body,
            )
            answer = keeper.receive(10)
            assert answer.command == "RECEIPT", answer
            confirmed.append(body)

        one_round()
        grown = rss(live.pid) - start_rss
        print(f"fuzz: {len(confirmed)} rounds, live RSS grew {grown / MiB:.1f} MiB")
        assert grown <= RSS_BOUND, f"the live's RSS grew {grown / MiB:.1f} MiB"
        keeper.close()
        # The backup held on through it all: the confirmed messages are all on it.
        pair.kill(live)
        backup = pair.wait_active(pair.lease * 1.2 + 10)
        reader = WireClient(backup.stomp_port, timeout=10)
        try:
            assert reader.connect().command == "CONNECTED"
            reader.send("SUBSCRIBE", {"id": "s", "destination": destination})
            got = [reader.receive(10).body for _ in confirmed]
        finally:
            reader.close()
        assert sorted(got) == sorted(confirmed)
