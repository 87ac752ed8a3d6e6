"""The CLI clients through a failover: `hafailover producer` and `hafailover consumer` run as
processes against the bundled pair while its live is SIGKILLed; their --record files must
show every confirmed seq received, none twice (duplicate detection is on by default)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reference_broker.pair import BrokerPair

pytestmark = [pytest.mark.broker, pytest.mark.timeout(90)]

FAST = (
    "initial_connect_attempts=5&heartbeat=250ms&retry_interval=50ms&max_retry_interval=500ms"
    "&call_failover_timeout=20s"
)


def hafailover(*args: str) -> list[str]:
    return [sys.executable, "-m", "hafailover.cli", *args]


def read_record(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_lines(path: Path, count: int, process: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(read_record(path)) < count:
        assert process.poll() is None, "the producer ended before the kill"
        assert time.monotonic() < deadline, f"{path.name} never reached {count} lines"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("protocol", "producer_args"),
    [
        ("stomp", ["--tx-batch", "10"]),
        ("amqp", ["--tx-batch", "10"]),
        ("stomp", ["--pipeline", "20"]),
        ("amqp", ["--pipeline", "20"]),
    ],
    ids=["stomp-transacted", "amqp-transacted", "stomp-pipelined", "amqp-pipelined"],
)
def test_producer_and_consumer_survive_sigkill_of_live(
    tmp_path: Path, protocol: str, producer_args: list[str]
) -> None:
    count = 400
    produced, consumed = tmp_path / "produced.jsonl", tmp_path / "consumed.jsonl"
    with BrokerPair(tmp_path / "pair", user="app", password="secret") as pair:
        url = (pair.stomp_url if protocol == "stomp" else pair.amqp_url) + "?" + FAST
        common = ["--url", url, "--destination", "queue://cli", "--json"]
        producer = subprocess.Popen(
            hafailover(
                "producer", *common, "--count", str(count), "--sleep", "3",
                "--record", str(produced), *producer_args,
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        consumer = subprocess.Popen(
            hafailover(
                "consumer", *common, "--idle-timeout", "5", "--ack-mode", "transacted",
                "--batch", "10", "--record", str(consumed),
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for_lines(produced, count // 3, producer, timeout=30)
            pair.kill(pair.live)
            p_out, p_err = producer.communicate(timeout=60)
            c_out, c_err = consumer.communicate(timeout=60)
        finally:
            for process in (producer, consumer):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert producer.returncode == 0, p_out + p_err
    assert consumer.returncode == 0, c_out + c_err
    p_summary, c_summary = json.loads(p_out), json.loads(c_out)
    assert p_summary["failovers"] >= 1 and c_summary["failovers"] >= 1

    sent = read_record(produced)
    assert [entry["seq"] for entry in sent] == list(range(count))
    confirmed = {entry["seq"] for entry in sent if entry["outcome"] == "confirmed"}
    assert len(confirmed) == count == p_summary["confirmed"], p_summary
    received = [entry["seq"] for entry in read_record(consumed)]
    said = f"consumer: {c_out}{c_err}"
    assert confirmed - set(received) == set(), said  # lost
    assert set(received) - confirmed == set(), said  # unexpected
    duplicates = sorted({seq for seq in received if received.count(seq) > 1})
    assert duplicates == [], said
