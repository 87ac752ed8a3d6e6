"""`hafailover pair up` never uses a well-known password and never prints one.

Without --password or $HAFAILOVER_PASSWORD it makes a random password and writes it to
DATA_DIR/password (0600); the URLs it prints carry no credentials, and it says where the
password is. A password the user gave is not printed either.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import hafailover
from hafailover.errors import HaFailoverError

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


@contextmanager
def pair_up(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "reference_broker", "pair", "up", *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def read_until(process: subprocess.Popen[bytes], marker: str, timeout: float = 60) -> str:
    """What pair up printed up to ``marker``, read from the pipe itself (no buffer between)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    data = b""
    while marker.encode() not in data:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"pair up printed no {marker!r} in {timeout}s: {data!r}"
        chunk = os.read(fd, 65536)
        assert chunk, f"pair up ended: {data!r}"
        data += chunk
    return data.decode()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HAFAILOVER_PASSWORD"}


def test_a_random_password_kept_in_a_private_file_and_urls_without_it(tmp_path: Path) -> None:
    data = tmp_path / "pair"
    with pair_up(["--json", "--data-dir", str(data)], clean_env()) as process:
        output = read_until(process, "\n")
        description = json.loads(output)
        password_file = Path(description["password_file"])
        assert password_file == data / "password"
        assert password_file.stat().st_mode & 0o777 == 0o600
        password = password_file.read_text().strip()
        assert len(password) >= 20 and password != "admin"
        assert password not in output
        url = description["stomp_url"]
        assert "@" not in url and "@" not in description["amqp_url"]
        with hafailover.connect(url, user=description["user"], password=password) as connection:
            session = connection.create_session()
            session.create_producer("queue://pair-up").send("hello")
        # The old default no longer gets in.
        with pytest.raises(HaFailoverError):
            hafailover.connect(
                url + "?initial_connect_attempts=1&reconnect_attempts=0",
                user="admin",
                password="admin",
            )


def test_a_password_given_is_used_and_not_printed(tmp_path: Path) -> None:
    env = clean_env() | {"HAFAILOVER_PASSWORD": "given-pw-4711"}
    with pair_up(["--data-dir", str(tmp_path / "pair")], env) as process:
        output = read_until(process, "Ctrl-C stops both nodes")
    assert "given-pw-4711" not in output
    assert "with the password you gave" in output
    assert "STOMP failover URL: failover:(stomp://127.0.0.1:" in output
    assert not (tmp_path / "pair" / "password").exists()
