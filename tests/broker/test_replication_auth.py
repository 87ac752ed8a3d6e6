"""The replication link proves both ends hold the pair secret: impostors get nothing.

Real node processes (BrokerPair) and raw sockets playing the impostor; the pair secret's
file rules (created 0600 once, refused when others may read it) on real files.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reference_broker.pair import BrokerPair, NodeProcess
from reference_broker.replication import (
    PAIR_SECRET_NAME,
    Kind,
    PairSecretError,
    load_pair_secret,
)
from reference_broker.tls import make_certificates
from tests.broker.stomp_wire import WireClient

pytestmark = [pytest.mark.broker]

HEARTBEAT = 1.0
BODY = b"replicated-body-" + secrets.token_hex(8).encode()


def frame(kind: Kind, payload: bytes = b"") -> bytes:
    return struct.pack("<IB", len(payload) + 1, kind) + payload


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the live sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def kinds(data: bytes) -> list[Kind]:
    out = []
    while len(data) >= 5:
        (length,) = struct.unpack("<I", data[:4])
        out.append(Kind(data[4]))
        data = data[4 + length :]
    return out


def send_persistent_body(node: NodeProcess, body: bytes) -> None:
    client = WireClient(node.stomp_port)
    try:
        assert client.connect().command == "CONNECTED"
        client.send(
            "SEND", {"destination": "/queue/secrets", "persistent": "true", "receipt": "r"}, body
        )
        assert client.receive().command == "RECEIPT"
    finally:
        client.sock.close()


def impostor_hello(node_id: str = "backup") -> bytes:
    hello = {"node_id": node_id, "nonce": secrets.token_hex(32)}
    return frame(Kind.HELLO, json.dumps(hello).encode())


@pytest.mark.timeout(120)
def test_an_impostor_gets_no_journal_byte_and_cannot_take_the_backup_slot(
    tmp_path: Path,
) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=HEARTBEAT) as pair:
        live, backup = pair.live, pair.backup
        send_persistent_body(live, BODY)
        pair.kill(backup)  # the slot is free: impostors try to take it
        port = live.replication_port
        received: dict[str, bytes] = {}

        # 1. The HELLO of a node that does not know the protocol's proofs (no nonce).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(frame(Kind.HELLO, json.dumps({"node_id": "backup"}).encode()))
            received["old hello"] = read_all(sock)
        # 2. A proper HELLO, then a made-up PROOF.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(impostor_hello())
            sock.sendall(frame(Kind.PROOF, secrets.token_hex(32).encode()))
            received["wrong proof"] = read_all(sock)
        # 3. Straight to the point: an ACK and a HANDOVER with no HELLO.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(frame(Kind.ACK, struct.pack("<Q", 10**9)) + frame(Kind.HANDOVER))
            received["ack"] = read_all(sock)
        # 4. Many that say HELLO and then nothing, while the real backup comes back.
        holders = []
        try:
            for _ in range(20):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(impostor_hello())
                holders.append(sock)
            pair.restart(backup)
            pair.wait_synchronized(30)
            for i, sock in enumerate(holders):
                received[f"holder {i}"] = read_all(sock)
        finally:
            for sock in holders:
                sock.close()
        assert live.role == "live"
    for what, data in received.items():
        assert BODY not in data, what
        assert set(kinds(data)) <= {Kind.CHALLENGE, Kind.PING}, (what, kinds(data))
    log = (tmp_path / "pair" / "live.log").read_text()
    assert "does not hold this pair's secret (wrong proof)" in log


@pytest.mark.timeout(90)
def test_a_backup_with_the_wrong_secret_is_refused_and_the_live_runs_alone(
    tmp_path: Path,
) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=HEARTBEAT, start_backup=False) as pair:
        live, backup = pair.nodes
        wrong = tmp_path / "wrong.secret"
        wrong.write_text(secrets.token_hex(32) + "\n")
        wrong.chmod(0o600)
        process = subprocess.Popen(
            [
                sys.executable, "-m", "reference_broker", "run",
                "--node-id", "backup", "--role", "backup",
                "--data-dir", str(backup.data_dir), "--pair-dir", str(pair.pair_dir),
                "--stomp-port", str(backup.stomp_port), "--amqp-port", str(backup.amqp_port),
                "--replication-port", str(backup.replication_port),
                "--peer-replication-port", str(live.replication_port),
                "--users", str(pair.users_file),
                "--heartbeat-timeout", str(HEARTBEAT), "--lease", str(pair.lease),
                "--pair-secret-file", str(wrong),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "wrong-backup.log", "wb"),  # noqa: SIM115 - the child's
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            live_log = tmp_path / "pair" / "live.log"
            deadline = time.monotonic() + 30
            while "does not hold this pair's secret" not in live_log.read_text():
                assert time.monotonic() < deadline, "the live never refused the backup"
                assert process.poll() is None, "the backup exited"
                time.sleep(0.1)
            time.sleep(3 * HEARTBEAT)  # it keeps trying, and keeps being refused
            status = live.status()
            assert status["role"] == "live" and status["degraded"], status
            backup_status = json.loads((backup.data_dir / "status.json").read_text())
            assert backup_status["role"] == "backup"
            assert not backup_status["synchronized"]
            send_persistent_body(live, BODY)  # the live serves alone
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
    live_text = (tmp_path / "pair" / "live.log").read_text()
    assert "refused a backup connection" in live_text
    assert "node 'backup' does not hold this pair's secret (wrong proof)" in live_text
    backup_text = (tmp_path / "wrong-backup.log").read_text()
    assert "does not hold this pair's secret (wrong proof): refusing to follow it" in backup_text
    assert "synchronizing from live" not in backup_text


@pytest.mark.timeout(120)
def test_with_tls_the_replication_link_is_encrypted(tmp_path: Path) -> None:
    tls = make_certificates(tmp_path / "tls")
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=HEARTBEAT, tls=tls) as pair:
        live = pair.live
        port = live.replication_port
        # In clear, the live does not even answer a HELLO: it expects a TLS handshake.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(impostor_hello())
            assert Kind.CHALLENGE not in kinds(read_all(sock))
        # Over TLS it presents the pair's certificate, and then asks for the proof.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw) as sock,
        ):
            der = sock.getpeercert(binary_form=True)
            assert der == ssl.PEM_cert_to_DER_cert(tls.cert.read_text())
            sock.sendall(impostor_hello())
            data = read_all(sock)
            assert kinds(data)[:1] == [Kind.CHALLENGE]
        # The backup proved itself over TLS too (it could not have in clear).
        assert pair.backup.status()["synchronized"]


def test_the_first_node_creates_the_secret_0600_and_both_read_the_same(tmp_path: Path) -> None:
    pair_dir = tmp_path / "pair"
    pair_dir.mkdir()
    first = load_pair_secret(pair_dir)
    assert load_pair_secret(pair_dir) == first
    path = pair_dir / PAIR_SECRET_NAME
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(first) == 32
    assert not [p for p in pair_dir.iterdir() if p.name != PAIR_SECRET_NAME]


def test_an_unsafe_missing_or_short_secret_is_refused_by_name(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.write_text(secrets.token_hex(32))
    loose.chmod(0o644)
    with pytest.raises(PairSecretError, match=f"{loose} is readable by others"):
        load_pair_secret(tmp_path, loose)
    with pytest.raises(PairSecretError, match="does not exist"):
        load_pair_secret(tmp_path, tmp_path / "absent")
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(PairSecretError, match="at least 16"):
        load_pair_secret(tmp_path, short)
    garbage = tmp_path / "garbage"
    garbage.write_text("not hex at all")
    garbage.chmod(0o600)
    with pytest.raises(PairSecretError, match="hex digits"):
        load_pair_secret(tmp_path, garbage)
