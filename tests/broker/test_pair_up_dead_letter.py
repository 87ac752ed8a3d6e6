"""`hafailover pair up --max-delivery-attempts N --dead-letter-queue queue://NAME` gives
both nodes the dead-letter settings: a message whose deliveries keep failing lands in that
queue after N of them, on the live and on the backup after a SIGKILL of the live. A bad
value is refused by name before any node starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hafailover
from hafailover import AckMode, Message

from .test_pair_up_password import clean_env, pair_up, read_until

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

FAST = "heartbeat=250ms&retry_interval=50ms&max_retry_interval=500ms"


def test_the_dead_letter_options_reach_both_nodes(tmp_path: Path) -> None:
    env = clean_env() | {"HAFAILOVER_PASSWORD": "dlq-pw"}
    args = ["--json", "--data-dir", str(tmp_path / "pair")]
    args += ["--max-delivery-attempts", "2", "--dead-letter-queue", "queue://poison"]
    with pair_up(args, env) as process:
        description = json.loads(read_until(process, "\n"))
        url = f"{description['stomp_url']}?{FAST}"
        calls: list[int] = []
        lock = threading.Lock()

        def always_fails(message: Message) -> None:
            with lock:
                calls.append(message.delivery_count)
            raise RuntimeError("this message always fails")

        with hafailover.connect(url, user="admin", password="dlq-pw") as connection:
            session = connection.create_session(AckMode.AUTO)
            session.create_producer("queue://orders").send(Message(body="poison"))
            session.create_consumer("queue://orders").set_message_listener(always_fails)
            connection.start()
            deadline = time.monotonic() + 20
            while len(calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.5)  # the nodes' limit, not the default 10: no third delivery
            assert calls == [0, 1]
            # The backup was started with the same queue: after the live's SIGKILL the
            # dead letter is there, under the name given.
            live = next(n for n in description["nodes"] if n["role"] == "live")
            os.kill(live["pid"], signal.SIGKILL)
            dead = connection.create_session(AckMode.AUTO).create_consumer("queue://poison")
            letter = dead.receive(20)
            assert letter is not None
            assert letter.body_bytes == b"poison"
            assert connection.statistics().failovers == 1


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--max-delivery-attempts", "-1", "must be 0 or more"),
        ("--max-delivery-attempts", "many", "not a whole number"),
        ("--dead-letter-queue", "topic://poison", "must be a queue://NAME"),
    ],
)
def test_a_bad_dead_letter_option_is_refused_by_name(
    tmp_path: Path, option: str, value: str, words: str
) -> None:
    data = tmp_path / "pair"
    command = [sys.executable, "-m", "reference_broker", "pair", "up", "--data-dir", str(data)]
    result = subprocess.run(
        [*command, option, value],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
        check=False,
    )
    assert result.returncode == 2
    assert option in result.stderr
    assert words in result.stderr
    assert not (data / "live").exists()  # refused before any node started
