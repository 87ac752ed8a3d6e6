"""Duplicate ids are kept for a duration as well as a count (issue 20, docs/broker.md).

An id is forgotten only when it is both older than `duplicate_id_retention` and beyond the
newest `duplicate_cache_size` ids of its address, or when the address's ids exceed
`duplicate_id_max_bytes` (logged once, with the address). The time each id entered is
journaled, so the rule holds after a restart and a failover.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from reference_broker import BrokerPair
from reference_broker.engine import DUPLICATE_ID_OVERHEAD, Engine, EngineConfig
from reference_broker.message import Message
from reference_broker.node import build_parser, config_from_args
from reference_broker.records import (
    DuplicateId,
    MessageAdd,
    Record,
    RecordError,
    RecordType,
    TxDuplicateId,
    decode,
)

from .stomp_wire import WireClient

Q = "queue://orders"
T = "topic://prices"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **options: object) -> Engine:
    return Engine(EngineConfig(clock=clock, **options))  # type: ignore[arg-type]


def send(engine: Engine, duplicate_id: str, address: str = Q) -> int | None:
    return engine.send(address, b"", persistent=True, duplicate_id=duplicate_id)


def round_trip(records: list[Record]) -> list[Record]:
    # Through bytes and the decoder, as a journal replay and the replication link do.
    return [decode(*record.encode()) for record in records]


def test_an_id_beyond_the_count_but_within_the_retention_is_still_a_duplicate() -> None:
    clock = Clock()
    engine = make(clock, duplicate_cache_size=2, duplicate_id_retention=100.0)
    for d in "abcd":
        send(engine, d)
    clock.now += 99.0
    assert send(engine, "a") is None
    assert engine.persistent_state().duplicate_ids == {Q: ("a", "b", "c", "d")}


def test_an_id_older_than_the_retention_but_within_the_count_is_still_a_duplicate() -> None:
    clock = Clock()
    engine = make(clock, duplicate_cache_size=2, duplicate_id_retention=10.0)
    send(engine, "a")
    clock.now += 1000.0
    send(engine, "b")
    assert send(engine, "a") is None


def test_an_id_both_older_and_beyond_the_count_is_forgotten() -> None:
    clock = Clock()
    engine = make(clock, duplicate_cache_size=2, duplicate_id_retention=100.0)
    for d in "abcd":
        send(engine, d)
    clock.now += 101.0
    send(engine, "e")
    # a, b, c are old and beyond the newest two; d is old but within them.
    assert engine.persistent_state().duplicate_ids == {Q: ("d", "e")}
    assert send(engine, "d") is None
    assert send(engine, "a") is not None


def test_the_byte_bound_forgets_within_the_retention_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    per_id = len("id-0") + DUPLICATE_ID_OVERHEAD
    engine = make(
        clock,
        duplicate_cache_size=1,
        duplicate_id_retention=3600.0,
        duplicate_id_max_bytes=3 * per_id,
    )
    with caplog.at_level(logging.WARNING, logger="reference_broker.engine"):
        for i in range(6):
            send(engine, f"id-{i}")
        send(engine, "x", address=T)  # another address has a bound of its own
    assert engine.persistent_state().duplicate_ids == {
        Q: ("id-3", "id-4", "id-5"),
        T: ("x",),
    }
    warnings = [r.getMessage() for r in caplog.records if "duplicate ids of" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert Q in warnings[0]
    assert send(engine, "id-0") is not None


def test_times_are_journaled_and_survive_recovery() -> None:
    clock = Clock()
    config = {"duplicate_cache_size": 1, "duplicate_id_retention": 100.0}
    engine = make(clock, **config)
    send(engine, "a")  # MESSAGE_ADD
    send(engine, "t", address=T)  # DUPLICATE_ID: no durable queue
    records = round_trip(engine.drain_records())
    times = [
        (r.duplicate_id, r.duplicate_time if isinstance(r, MessageAdd) else r.time)
        for r in records
        if isinstance(r, MessageAdd | DuplicateId)
    ]
    assert times == [("a", clock.now), ("t", clock.now)]
    # Recovered much later: the ids are as old as their records say, not new.
    later = Clock(clock.now + 150.0)
    recovered = Engine.recover(records, EngineConfig(clock=later, **config))  # type: ignore[arg-type]
    assert send(recovered, "a") is None  # old but the newest one: kept
    send(recovered, "b")
    assert send(recovered, "a") is not None  # older than 100 s and beyond the count


def test_a_checkpoint_keeps_each_ids_time() -> None:
    clock = Clock()
    config = {"duplicate_cache_size": 1, "duplicate_id_retention": 100.0}
    engine = make(clock, **config)
    send(engine, "a")
    clock.now += 10.0
    send(engine, "b")
    body = round_trip(engine.checkpoint())
    times = {r.duplicate_id: r.time for r in body if isinstance(r, DuplicateId)}
    assert times == {"a": clock.now - 10.0, "b": clock.now}
    later = Clock(clock.now + 95.0)  # a is 105 s old, b 95 s
    recovered = Engine.recover(body, EngineConfig(clock=later, **config))  # type: ignore[arg-type]
    send(recovered, "c")
    assert recovered.persistent_state().duplicate_ids == {Q: ("b", "c")}


def test_records_without_a_time_still_decode_and_count_from_recovery() -> None:
    # A journal written before times were kept: no flag 8, no trailing time.
    old_add = MessageAdd((Q,), Message(1, Q, b"", {}, True, 4, None), "a")
    old_dup = DuplicateId(T, "t")
    records = round_trip([old_add, old_dup])
    assert records == [old_add, old_dup]
    clock = Clock()
    config = {"duplicate_cache_size": 1, "duplicate_id_retention": 100.0}
    recovered = Engine.recover(records, EngineConfig(clock=clock, **config))  # type: ignore[arg-type]
    clock.now += 50.0
    send(recovered, "b")
    assert send(recovered, "a") is None  # counted from its recovery: 50 s old


def test_a_bad_duplicate_time_is_refused_with_its_name() -> None:
    record = TxDuplicateId(1, T, "t", 5.0)
    assert decode(*record.encode()) == record
    with pytest.raises(RecordError, match="duplicate time"):
        DuplicateId(T, "t", float("nan")).encode()
    type_, payload = DuplicateId(T, "t").encode()
    with pytest.raises(RecordError, match="duplicate time"):
        decode(type_, payload + b"\x00\x00\x00\x00\x00\x00\xf0\x7f")  # +inf
    with pytest.raises(RecordError):
        decode(RecordType.DUPLICATE_ID, payload + b"\x00\x00")  # neither a time nor nothing


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("duplicate_id_retention", -1.0, "duplicate_id_retention"),
        ("duplicate_id_max_bytes", 0, "duplicate_id_max_bytes"),
    ],
)
def test_bad_retention_options_are_refused_by_name(option: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        EngineConfig(**{option: value})  # type: ignore[arg-type]


def test_an_id_is_still_a_duplicate_after_a_restart_and_a_failover(tmp_path: Path) -> None:
    """With a count of 2, ids sent before 10 later ones are kept by their retention (1 h):
    after a failover to the backup (which recovers the records the live replicated), and
    after the killed node is restarted, synchronizes and takes over in turn."""
    options = ["--duplicate-id-cache-size", "2", "--duplicate-id-retention", "3600"]
    destination = "/queue/retention"
    with BrokerPair(tmp_path / "pair", allow_failback=False, node_options=options) as pair:
        pair.wait_synchronized(30)

        def send_stamped(duplicate_id: str) -> None:
            client = WireClient(pair.live.stomp_port)
            try:
                assert client.connect().command == "CONNECTED"
                headers = {
                    "destination": destination,
                    "persistent": "true",
                    "_AMQ_DUPL_ID": duplicate_id,
                    "receipt": "r",
                }
                client.send("SEND", headers, duplicate_id.encode())
                assert client.receive_until("RECEIPT", timeout=10.0)[-1].get("receipt-id") == "r"
            finally:
                client.close()

        for i in range(12):
            send_stamped(f"id-{i}")
        first = pair.live
        pair.kill(first)  # a failover: the backup takes over with the replicated records
        second = pair.wait_active(20)
        assert second is not first
        send_stamped("id-0")
        pair.restart(first)  # a restart: it joins as backup and synchronizes
        pair.wait_synchronized(30)
        pair.kill(second)
        assert pair.wait_active(20) is first
        send_stamped("id-1")
        client = WireClient(pair.live.stomp_port)
        try:
            assert client.connect().command == "CONNECTED"
            client.send("SUBSCRIBE", {"destination": destination, "id": "s", "ack": "auto"})
            bodies = []
            with contextlib.suppress(TimeoutError):
                while True:
                    frame = client.receive(timeout=2.0)
                    if frame.command == "MESSAGE":
                        bodies.append(frame.body)
        finally:
            client.close()
    assert sorted(bodies) == sorted(f"id-{i}".encode() for i in range(12))


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--duplicate-id-retention", "-5", "must be a number of seconds >= 0"),
        ("--duplicate-id-retention", "1h", "not a number of seconds"),
        ("--duplicate-id-cache-size", "-1", "must be 0 or more"),
        ("--duplicate-id-max-bytes", "0", "must be at least 1 byte"),
    ],
)
def test_bad_node_options_are_refused_by_name(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--node-id", "n", "--role", "live", "--data-dir", "d", "--pair-dir", "p"]
    ports = ["--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, *ports, option, value])
    error = capsys.readouterr().err
    assert option in error
    assert words in error


def test_node_options_reach_the_node_config() -> None:
    base = ["--node-id", "n", "--role", "live", "--data-dir", "d", "--pair-dir", "p"]
    ports = ["--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"]
    options = ["--duplicate-id-retention", "7200", "--duplicate-id-cache-size", "5"]
    config = config_from_args(build_parser().parse_args([*base, *ports, *options]))
    assert config.duplicate_id_retention == 7200.0
    assert config.duplicate_id_cache_size == 5
    assert config.duplicate_id_max_bytes == 64 * 1024 * 1024
