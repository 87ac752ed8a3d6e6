"""consumer_dedup_file on the bundled broker with its duplicate detection off (as RabbitMQ
has none): every message is on the queue twice under one duplicate id, the second copy
after the first ones, as a failover's resends leave them. A consumer process is killed
(SIGKILL) mid-stream and started again: with the window kept in its file, the application
is handed each message once, across the restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hafailover
from hafailover import Message
from reference_broker import BrokerPair

from .support import single_url

pytestmark = pytest.mark.timeout(120)

QUEUE = "queue://kept-window"
COUNT = 150

# The consumer process: AUTO, hands each message to "the application" (a line in the out
# file), and after ``pause_after`` of them says so and waits to be killed (-1: never).
CONSUMER = """
import sys, time
import hafailover
url, queue, out, pause_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
handed = 0
with hafailover.connect(url) as connection, open(out, "a") as lines:
    consumer = connection.create_session().create_consumer(queue, prefetch=20)
    connection.start()
    while (message := consumer.receive(3.0)) is not None:
        lines.write(f"{message.properties['seq']}\\n")
        lines.flush()
        handed += 1
        if handed == pause_after:
            lines.write("paused\\n")
            lines.flush()
            time.sleep(600)
"""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(
        tmp_path / "pair",
        user="app",
        password="secret",
        start_backup=False,
        node_options=["--duplicate-id-cache-size", "0"],
    ) as pair:
        pair.wait_active(30)
        yield pair


def fill(url: str) -> None:
    """Each message, then (after all of them) its copy under the same duplicate id."""
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(QUEUE)
        for _copy in range(2):
            for n in range(COUNT):
                producer.send(Message(f"m{n}", {"seq": n}, message_id=f"order-{n}"))


def run_consumer(url: str, out: Path, pause_after: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CONSUMER, url, QUEUE, str(out), str(pause_after)],
        stdin=subprocess.DEVNULL,
    )


def lines(out: Path) -> list[str]:
    return out.read_text().split() if out.exists() else []


def wait_for(predicate: object, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():  # type: ignore[operator]
        assert process.poll() is None, f"the consumer ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, 9)
    process.wait(10)


@pytest.mark.parametrize("stop", ["paused", "mid-stream"])
def test_a_killed_consumer_restarted_hands_out_each_message_once(
    broker: BrokerPair, tmp_path: Path, stop: str
) -> None:
    base = single_url("stomp", "127.0.0.1", broker.live.stomp_port, broker)
    fill(base)
    url = f"{base}&consumer_dedup=1000&consumer_dedup_file={tmp_path / 'window'}"
    out = tmp_path / "handed"
    first = run_consumer(url, out, 60 if stop == "paused" else -1)
    try:
        if stop == "paused":
            wait_for(lambda: "paused" in lines(out), first, "60 messages")
        else:
            wait_for(lambda: len(lines(out)) >= 60, first, "60 messages")
    finally:
        kill(first)
    second = run_consumer(url, out, -1)
    try:
        second.wait(60)
    finally:
        if second.poll() is None:
            kill(second)
    handed = [int(line) for line in lines(out) if line != "paused"]
    assert len(handed) == len(set(handed)), "a message was handed out twice"
    missing = set(range(COUNT)) - set(handed)
    if stop == "paused":
        assert not missing
    else:
        # AUTO: a message is the application's once receive() returned it; one killed
        # before the application wrote it down is gone with the process, as in JMS.
        assert len(missing) <= 1
