"""The pair's dead-letter settings: --max-delivery-attempts and --dead-letter-queue reach
both nodes, and what the live dead-lettered is in the backup's dead-letter queue after a
SIGKILL of the live (the dead-lettering is journaled and replicated)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import hafailover
from hafailover import AckMode, Message
from reference_broker import BrokerPair
from reference_broker.node import build_parser, config_from_args

BASE = ["--node-id", "n", "--role", "live", "--data-dir", "d", "--pair-dir", "p"]
PORTS = ["--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"]


def test_the_options_reach_the_node_config() -> None:
    options = ["--max-delivery-attempts", "2", "--dead-letter-queue", "queue://poison"]
    config = config_from_args(build_parser().parse_args([*BASE, *PORTS, *options]))
    assert (config.max_delivery_attempts, config.dead_letter_queue) == (2, "queue://poison")
    default = config_from_args(build_parser().parse_args([*BASE, *PORTS]))
    assert (default.max_delivery_attempts, default.dead_letter_queue) == (10, "queue://DLQ")


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--max-delivery-attempts", "-1", "must be 0 or more"),
        ("--dead-letter-queue", "topic://x", "must be a queue://NAME"),
        ("--dead-letter-queue", "queue://", "must be a queue://NAME"),
    ],
)
def test_bad_values_are_refused_by_name(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, *PORTS, option, value])
    error = capsys.readouterr().err
    assert option in error
    assert words in error


@pytest.mark.parametrize("protocol", ["stomp", "amqp"])
def test_what_the_live_dead_lettered_is_on_the_backup(tmp_path: Path, protocol: str) -> None:
    options = ["--max-delivery-attempts", "2", "--dead-letter-queue", "queue://poison"]
    with BrokerPair(tmp_path / "pair", user="app", password="secret", node_options=options) as pair:
        pair.wait_synchronized(30)
        base = pair.stomp_url if protocol == "stomp" else pair.amqp_url
        url = f"{base}?heartbeat=250ms&retry_interval=50ms&max_retry_interval=500ms"
        calls: list[int] = []
        lock = threading.Lock()

        def always_fails(message: Message) -> None:
            with lock:
                calls.append(message.delivery_count)
            raise RuntimeError("this message always fails")

        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.AUTO)
            session.create_producer("queue://orders").send(Message(body="poison"))
            session.create_consumer("queue://orders").set_message_listener(always_fails)
            connection.start()
            deadline = time.monotonic() + 20
            while len(calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.5)  # the broker, not the client, decides: no third delivery
            assert calls == [0, 1]
            victim = pair.live
            pair.kill(victim)
            other = pair.nodes[1] if victim is pair.nodes[0] else pair.nodes[0]
            deadline = time.monotonic() + 20
            while other.role != "live" and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = connection.create_session(AckMode.AUTO).create_consumer("queue://poison")
            letter = dead.receive(10)
            assert letter is not None
            assert letter.body_bytes == b"poison"
            assert connection.statistics().failovers == 1
