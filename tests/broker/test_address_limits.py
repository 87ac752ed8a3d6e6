"""Address limits and the address-full policy (--max-address-bytes, --max-address-messages,
--address-full-policy, --address-limit): what an address counts, FAIL refusing a send with
the address and the limit named while the connection goes on, BLOCK holding the producer
until a consumer makes room, the client's AddressFullError and back-pressure, and the same
limits on the backup after a failover. Engine rules first, then the real pair."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from proton import Delivery, Endpoint, Message

import hafailover
from hafailover import AckMode, AddressFullError, CallTimeoutError, FailoverNotice
from reference_broker.engine import (
    MESSAGE_OVERHEAD,
    AddressFullPolicy,
    AddressLimit,
    Engine,
    EngineConfig,
)
from reference_broker.engine import (
    AddressFullError as EngineAddressFull,
)
from reference_broker.node import build_parser, config_from_args
from reference_broker.pair import BrokerPair
from reference_broker.records import decode
from reference_broker.users import UsersFile
from tests.broker.stomp_wire import WireClient
from tests.broker.test_amqp_server import InProcessBroker, RawClient
from tests.integration.support import url_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

Q = "queue://limited"
LIMIT = 5  # messages, in the pair below


def engine_with(limit: AddressLimit, **limits: AddressLimit) -> Engine:
    return Engine(EngineConfig(address_limit=limit, address_limits=limits))


# --- the engine's rules ----------------------------------------------------------------------


def test_a_full_address_refuses_naming_itself_and_its_limit_until_an_ack_makes_room() -> None:
    engine = engine_with(AddressLimit(max_bytes=0, max_messages=2))
    connection = engine.connect()
    consumer = engine.subscribe(connection, Q, ack_mode=AckMode.CLIENT_INDIVIDUAL)
    engine.send(Q, b"1", persistent=True)
    engine.send(Q, b"2", persistent=True)
    with pytest.raises(EngineAddressFull) as refused:
        engine.send(Q, b"3", persistent=True)
    text = str(refused.value)
    assert "send to queue://limited refused: address queue://limited is full" in text
    assert "2 messages (--max-address-messages)" in text and "policy FAIL" in text
    assert not refused.value.blocking
    # Delivered but not acknowledged still counts: the message is still the broker's.
    first = engine.poll(0.0)[0]
    assert engine.address_usage(Q)[0] == 2
    with pytest.raises(EngineAddressFull):
        engine.send(Q, b"3")
    assert engine.drain_freed() == []
    engine.ack(consumer, first.tag)
    assert engine.drain_freed() == [Q]  # the server lets held producers go on
    assert engine.send(Q, b"3") is not None
    assert engine.drain_freed() == []


def test_bytes_count_body_headers_and_overhead_and_an_address_may_have_its_own_limit() -> None:
    size = len(b"body") + len("k") + len("value") + MESSAGE_OVERHEAD
    engine = engine_with(
        AddressLimit(max_bytes=2 * size),
        **{"queue://roomy": AddressLimit(max_bytes=0, policy=AddressFullPolicy.BLOCK)},
    )
    for _ in range(2):
        engine.send(Q, b"body", headers={"k": "value"})
    assert engine.address_usage(Q) == (2, 2 * size)
    with pytest.raises(EngineAddressFull, match=f"{2 * size} bytes \\(--max-address-bytes\\)"):
        engine.send(Q, b"x")
    for _ in range(10):
        engine.send("queue://roomy", b"body" * 100)  # no limit there
    # A topic's subscriptions hold a copy each: the message counts once per subscription.
    connection = engine.connect()
    for _ in range(2):
        engine.subscribe(connection, "topic://news", ack_mode=AckMode.CLIENT)
    engine.send("topic://news", b"body", headers={"k": "value"})
    assert engine.address_usage("topic://news") == (2, 2 * size)


def test_the_blocking_policy_says_so_and_a_duplicate_retry_is_accepted_while_full() -> None:
    engine = engine_with(AddressLimit(max_bytes=0, max_messages=1, policy=AddressFullPolicy.BLOCK))
    engine.send(Q, b"1", persistent=True, duplicate_id="one")
    with pytest.raises(EngineAddressFull, match="held: address queue://limited is full") as held:
        engine.send(Q, b"2", persistent=True, duplicate_id="two")
    assert held.value.blocking and held.value.address == Q
    # A retry of what is stored stores nothing: accepted, full or not.
    assert engine.send(Q, b"1", persistent=True, duplicate_id="one") is None


def test_a_transaction_counts_its_sends_from_the_send_and_a_rollback_gives_them_back() -> None:
    engine = engine_with(AddressLimit(max_bytes=0, max_messages=2))
    connection = engine.connect()
    tx = engine.begin(connection)
    engine.send(Q, b"1", tx=tx)
    engine.send(Q, b"2", tx=tx)
    with pytest.raises(EngineAddressFull):
        engine.send(Q, b"3")  # nothing is in the queue yet, but the transaction holds two
    engine.rollback(tx)
    assert engine.address_usage(Q) == (0, 0)
    tx = engine.begin(connection)
    engine.send(Q, b"1", tx=tx)
    engine.commit(tx)
    assert engine.address_usage(Q)[0] == 1 and len(engine.browse(Q)) == 1


def test_recovery_counts_what_it_rebuilds() -> None:
    """The backup, recovering from the same records with the same limits, is as full."""
    config = EngineConfig(address_limit=AddressLimit(max_bytes=0, max_messages=2))
    engine = Engine(config)
    engine.send(Q, b"1", persistent=True)
    engine.send(Q, b"2", persistent=True)
    records = [decode(*r.encode()) for r in engine.drain_records()]
    recovered = Engine.recover(records, config)
    assert recovered.address_usage(Q) == engine.address_usage(Q)
    with pytest.raises(EngineAddressFull):
        recovered.send(Q, b"3", persistent=True)


# --- the servers, in this process ----------------------------------------------------------


def one_message_per_address(tmp_path: Path, policy: AddressFullPolicy) -> InProcessBroker:
    users = UsersFile()
    users.add("admin", "admin")
    limit = AddressLimit(max_bytes=0, max_messages=1, policy=policy)
    return InProcessBroker(
        tmp_path, users, heartbeat=5.0, engine_config=EngineConfig(address_limit=limit)
    )


@pytest.fixture
def blocking(tmp_path: Path) -> Iterator[InProcessBroker]:
    """BLOCK at one message per address."""
    broker = one_message_per_address(tmp_path, AddressFullPolicy.BLOCK)
    yield broker
    broker.close()


def test_stomp_block_holds_the_send_and_every_frame_after_it_in_order(
    blocking: InProcessBroker,
) -> None:
    producer = WireClient(blocking.stomp_port)
    consumer = WireClient(blocking.stomp_port)
    try:
        assert producer.connect().command == "CONNECTED"
        producer.send("SEND", {"destination": "/queue/b", "receipt": "r1"}, b"1")
        assert producer.receive(5).get("receipt-id") == "r1"
        producer.send("SEND", {"destination": "/queue/b", "receipt": "r2"}, b"2")  # held
        producer.send("SEND", {"destination": "/queue/other", "receipt": "r3"}, b"3")
        with pytest.raises(TimeoutError):
            producer.receive(1.0)  # neither: the second waits behind the first
        assert consumer.connect().command == "CONNECTED"
        consumer.send("SUBSCRIBE", {"id": "s", "destination": "/queue/b", "ack": "client"})
        first = consumer.receive(5)
        assert first.body == b"1"
        consumer.send("ACK", {"id": first.get("ack") or ""})
        assert [producer.receive(5).get("receipt-id") for _ in range(2)] == ["r2", "r3"]
        assert consumer.receive(5).body == b"2"
    finally:
        producer.close()
        consumer.close()


@pytest.fixture
def failing(tmp_path: Path) -> Iterator[InProcessBroker]:
    """FAIL at one message per address."""
    broker = one_message_per_address(tmp_path, AddressFullPolicy.FAIL)
    yield broker
    broker.close()


def test_stomp_fail_holds_a_send_that_asked_for_no_receipt_rather_than_confirm_it_unstored(
    failing: InProcessBroker,
) -> None:
    """A pipelined SEND (no receipt header) cannot be named by a refusal, and the receipt of
    a later frame confirms every frame before it: refused, it would be confirmed and lost.
    Under FAIL it is held instead, and stored once a consumer makes room."""
    producer = WireClient(failing.stomp_port)
    consumer = WireClient(failing.stomp_port)
    try:
        assert producer.connect().command == "CONNECTED"
        producer.send("SEND", {"destination": "/queue/f", "receipt": "r1"}, b"1")
        assert producer.receive(5).get("receipt-id") == "r1"
        producer.send("SEND", {"destination": "/queue/f"}, b"2")  # full: held, not refused
        producer.send("SEND", {"destination": "/queue/other", "receipt": "r3"}, b"3")
        with pytest.raises(TimeoutError):
            producer.receive(1.0)  # no ERROR, and no receipt that would confirm "2" unstored
        assert consumer.connect().command == "CONNECTED"
        consumer.send("SUBSCRIBE", {"id": "s", "destination": "/queue/f", "ack": "client"})
        first = consumer.receive(5)
        assert first.body == b"1"
        consumer.send("ACK", {"id": first.get("ack") or ""})
        assert producer.receive(5).get("receipt-id") == "r3"
        assert consumer.receive(5).body == b"2"  # stored after all
    finally:
        producer.close()
        consumer.close()


def test_amqp_block_refuses_a_transactional_transfer_rather_than_hold_it(
    blocking: InProcessBroker,
) -> None:
    client = RawClient(blocking.port)
    try:
        client.pump(lambda: bool(client.connection.state & Endpoint.REMOTE_ACTIVE))
        sender = client.sender("queue://tx")
        assert client.settled(client.send(sender, Message(body="1"))).remote_state == (
            Delivery.ACCEPTED
        )
        txn_id = client.declare(client.coordinator())
        refused = client.settled(client.send(sender, Message(body="2"), txn_id=txn_id))
        assert refused.remote_state == Delivery.REJECTED
        condition = refused.remote.condition
        assert condition is not None and condition.name == "amqp:resource-limit-exceeded"
        assert "a transactional send is refused, not held" in str(condition.description)
    finally:
        client.close()


# --- the real pair -----------------------------------------------------------------------------


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def start_pair(directory: Path) -> BrokerPair:
    """FAIL at LIMIT messages per address; queue://held-* and queue://timed-* BLOCK there."""
    blocking = [f"queue://{kind}-{p}" for kind in ("held", "timed") for p in ("stomp", "amqp")]
    options = [
        "--max-address-messages",
        str(LIMIT),
        *(f"--address-limit={address}=0,{LIMIT},BLOCK" for address in blocking),
    ]
    return BrokerPair(directory / "pair", node_options=options)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with start_pair(tmp_path) as pair:
        pair.wait_synchronized(30)
        yield pair


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerPair]:
    """For the tests that kill nothing."""
    with start_pair(tmp_path_factory.mktemp("limits")) as pair:
        yield pair


def test_fail_refuses_the_send_clearly_without_a_failover_and_the_backup_keeps_the_limit(
    pair: BrokerPair, protocol: str
) -> None:
    queue = f"queue://full-{protocol}-{uuid.uuid4().hex[:8]}"
    notices: list[hafailover.HaFailoverError] = []
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s")
    with hafailover.connect(url, exception_listener=notices.append) as connection:
        producer = connection.create_session().create_producer(queue)
        for n in range(LIMIT):
            producer.send(f"m{n}".encode(), persistent=True)
        with pytest.raises(AddressFullError) as refused:
            producer.send(b"over", persistent=True)
        assert queue in str(refused.value), refused.value
        assert f"{LIMIT} messages (--max-address-messages)" in str(refused.value)
        assert refused.value.code is hafailover.ErrorCode.ADDRESS_FULL
        # The same connection goes on: a consumer makes room, the next send is taken.
        consumer = connection.create_session(AckMode.CLIENT).create_consumer(queue)
        connection.start()
        taken = consumer.receive(10)
        assert taken is not None and taken.body == b"m0"
        taken.acknowledge()
        producer.send(b"after", persistent=True)
        assert not [n for n in notices if isinstance(n, FailoverNotice)], notices
        # The backup recovers the same messages and enforces the same limit.
        pair.kill(pair.live)
        with pytest.raises(AddressFullError):
            producer.send(b"over again", persistent=True)
    if protocol == "stomp":
        assert_stomp_refusal_names_the_receipt(pair, queue)


def assert_stomp_refusal_names_the_receipt(pair: BrokerPair, queue: str) -> None:
    """On the wire: an ERROR with the SEND's receipt-id, and the connection stays."""
    live = pair.wait_active(20)
    wire = WireClient(live.stomp_port)
    try:
        assert wire.connect(pair.user, pair.password).command == "CONNECTED"
        wire.send("SEND", {"destination": queue, "receipt": "r-over"}, b"over")
        error = wire.receive(10)
        assert error.command == "ERROR", error
        assert error.get("receipt-id") == "r-over"
        assert error.get("hafailover-code") == "ADDRESS_FULL"
        wire.send("SEND", {"destination": "/queue/elsewhere", "receipt": "r-ok"}, b"fine")
        assert wire.receive(10).get("receipt-id") == "r-ok"
    finally:
        wire.close()


def test_block_holds_the_producer_until_a_consumer_makes_room_and_loses_nothing(
    shared_pair: BrokerPair, protocol: str
) -> None:
    pair = shared_pair
    queue = f"queue://held-{protocol}"
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s", call_timeout="30s")
    sent: list[str] = []
    failed: list[BaseException] = []

    def produce() -> None:
        try:
            with hafailover.connect(url) as connection:
                producer = connection.create_session().create_producer(queue)
                for n in range(LIMIT + 2):
                    producer.send(f"m{n}".encode(), persistent=True)
                    sent.append(f"m{n}")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failed.append(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    deadline = time.monotonic() + 20
    while len(sent) < LIMIT and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert len(sent) == LIMIT, (sent, failed)  # the next send waits: back-pressure
    received: list[object] = []
    with hafailover.connect(url) as connection:
        consumer = connection.create_session(AckMode.AUTO).create_consumer(queue)
        connection.start()
        while len(received) < LIMIT + 2:
            message = consumer.receive(20)
            assert message is not None, (received, sent, failed)
            received.append(message.body)
    producer.join(20)
    assert not failed, failed
    assert received == [f"m{n}".encode() for n in range(LIMIT + 2)]


def test_block_is_bounded_by_the_clients_call_timeout(
    shared_pair: BrokerPair, protocol: str
) -> None:
    pair = shared_pair
    queue = f"queue://timed-{protocol}"
    url = url_for(pair, protocol, reconnect_attempts=-1, heartbeat="1s", call_timeout="2s")
    with hafailover.connect(url) as connection:
        producer = connection.create_session().create_producer(queue)
        for n in range(LIMIT):
            producer.send(f"m{n}".encode(), persistent=True)
        started = time.monotonic()
        with pytest.raises(CallTimeoutError):
            producer.send(b"held", persistent=True)
        assert time.monotonic() - started < 15


# --- the node's options ------------------------------------------------------------------------

BASE = ["--node-id", "n", "--role", "live", "--data-dir", "d", "--pair-dir", "p"]
PORTS = ["--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"]


def test_the_limit_options_reach_the_node_config_with_their_defaults() -> None:
    config = config_from_args(build_parser().parse_args([*BASE, *PORTS]))
    assert config.address_limit == AddressLimit(1024**3, 0, AddressFullPolicy.FAIL)
    assert config.address_limits == ()
    options = [
        "--max-address-bytes=0",
        "--max-address-messages=100",
        "--address-full-policy=block",
        "--address-limit=queue://orders=1048576,0,FAIL",
        "--address-limit=topic://prices=0,10",
    ]
    config = config_from_args(build_parser().parse_args([*BASE, *PORTS, *options]))
    assert config.address_limit == AddressLimit(0, 100, AddressFullPolicy.BLOCK)
    assert dict(config.address_limits) == {
        "queue://orders": AddressLimit(1048576, 0, AddressFullPolicy.FAIL),
        "topic://prices": AddressLimit(0, 10, AddressFullPolicy.BLOCK),
    }


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ("--max-address-bytes=-1", "must be 0 (no limit) or more"),
        ("--address-full-policy=PAGE", "not FAIL or BLOCK"),
        ("--address-limit=orders=1,2", "ADDRESS=BYTES,MESSAGES[,POLICY]"),
        ("--address-limit=queue://orders=1", "ADDRESS=BYTES,MESSAGES[,POLICY]"),
        ("--address-limit=queue://orders=1,x", "not a whole number"),
    ],
)
def test_a_bad_limit_option_is_refused_by_name(
    option: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, *PORTS, option])
    error = capsys.readouterr().err
    assert option.split("=")[0] in error and words in error, error
