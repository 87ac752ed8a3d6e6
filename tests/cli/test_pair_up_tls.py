"""`hafailover pair up --tls`: a pair with TLS listeners and throw-away certificates, whose
printed URLs a client uses as they are; Ctrl-C (SIGTERM here) stops both nodes."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import hafailover

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


def test_pair_up_with_tls_serves_both_protocols_and_stops(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "reference_broker", "pair", "up", "--tls", "--json",
         "--data-dir", str(tmp_path / "pair")],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "pair up printed nothing within 60 s"
        description = json.loads(process.stdout.readline())
        pids = [node["pid"] for node in description["nodes"]]
        assert description["tls_ca"] and Path(description["tls_ca"]).is_file()
        for url in (description["stomp_url"], description["amqp_url"]):
            assert url.startswith(("failover:(stomp+ssl://", "failover:(amqps://"))
            # The URLs carry no credentials; pair up says where the password is.
            password = Path(description["password_file"]).read_text().strip()
            with hafailover.connect(url, user=description["user"], password=password) as connection:
                session = connection.create_session()
                session.create_producer("queue://tls-cli").send("hello")
                consumer = session.create_consumer("queue://tls-cli")
                connection.start()
                received = consumer.receive(10)
                assert received is not None and received.text == "hello"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        for pid in pids:  # stopped with the pair, or killed here
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"node {pid} outlived pair up")
