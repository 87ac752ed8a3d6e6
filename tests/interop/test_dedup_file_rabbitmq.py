"""consumer_dedup_file on RabbitMQ 3.10, which has no duplicate detection, over STOMP and AMQP
1.0: every message is stored twice under one duplicate id (a resend after a failover leaves
the same), the copies after the first ones. A consumer process is SIGKILLed mid-stream and
started again: with its window kept in the file, the application is handed each message once
across the restart. The consumer process and the checks are those of the bundled broker's
version (tests/integration/test_dedup_file.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hafailover
from hafailover import Message
from tests.integration.test_dedup_file import CONSUMER, kill, lines, wait_for
from tests.interop.conftest import RabbitMQ
from tests.interop.test_client_rabbitmq import failover_url, unique_queue
from tests.interop.test_consumer_dedup_rabbitmq import deduplicating

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

COUNT = 150


def fill(url: str, queue: str) -> None:
    """Each message, then (after all of them) its copy under the same id: both stored."""
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        for _copy in range(2):
            for n in range(COUNT):
                producer.send(Message(f"m{n}", {"seq": n}, message_id=f"order-{n}"))


def consume(url: str, queue: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CONSUMER, url, queue, str(out), "-1"], stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_a_consumer_killed_and_restarted_hands_out_each_message_once(
    rabbitmq: RabbitMQ, protocol: str, tmp_path: Path
) -> None:
    base = deduplicating(failover_url(rabbitmq, protocol), window=1000)
    queue = unique_queue(f"kept-window-{protocol}")
    fill(base, queue)
    url = f"{base}&consumer_dedup_file={tmp_path / 'window'}"
    out = tmp_path / "handed"
    first = consume(url, queue, out)
    try:
        wait_for(lambda: len(lines(out)) >= 60, first, "60 messages")
    finally:
        kill(first)
    second = consume(url, queue, out)
    try:
        second.wait(60)
    finally:
        if second.poll() is None:
            kill(second)
    handed = [int(line) for line in lines(out)]
    twice = sorted(n for n in set(handed) if handed.count(n) > 1)
    missing = set(range(COUNT)) - set(handed)
    print(f"\n{protocol}: handed {len(handed)}, twice {len(twice)}, missing {sorted(missing)}")
    assert twice == [], "handed out twice across the restart"
    # AUTO: a message is the application's once receive() returned it; one killed before
    # the application wrote it down is gone with the process, as in JMS.
    assert len(missing) <= 1
