"""AMQP duplicate detection reads _AMQ_DUPL_ID only; the message-id only when the broker says so.

Issue 19: the broker took the message-id of every durable AMQP message for a duplicate id,
so a producer that reuses message-ids (a counter per connection, as some libraries keep)
lost messages without a word. Artemis reads only ``_AMQ_DUPL_ID``; so does this broker now,
unless it runs with ``--amqp-message-id-duplicates``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from proton import Message, Timeout
from proton.utils import BlockingConnection

from reference_broker.amqp.mapping import decode_incoming
from reference_broker.node import build_parser, config_from_args
from reference_broker.pair import BrokerPair, NodeProcess

COUNT = 60


def _encode(message: Message) -> bytes:
    return bytes(message.encode())


def test_the_duplicate_id_comes_from_amq_dupl_id_only_by_default() -> None:
    reused = _encode(Message(body="a", durable=True, id="7"))
    stamped = _encode(Message(body="b", durable=True, id="7", properties={"_AMQ_DUPL_ID": "d"}))
    assert decode_incoming(reused, 0.0).duplicate_id is None
    assert decode_incoming(stamped, 0.0).duplicate_id == "d"
    # The option: a durable message's message-id stands in for a missing _AMQ_DUPL_ID.
    assert decode_incoming(reused, 0.0, message_id_duplicates=True).duplicate_id == "7"
    assert decode_incoming(stamped, 0.0, message_id_duplicates=True).duplicate_id == "d"
    volatile = _encode(Message(body="c", durable=False, id="7"))
    assert decode_incoming(volatile, 0.0, message_id_duplicates=True).duplicate_id is None


def test_the_node_option_turns_message_id_duplicates_on() -> None:
    base = ["--node-id", "n", "--role", "live", "--data-dir", "d", "--pair-dir", "p"]
    base += ["--stomp-port", "1", "--amqp-port", "2", "--replication-port", "3"]
    parser = build_parser()
    assert not config_from_args(parser.parse_args(base)).amqp_message_id_duplicates
    on = parser.parse_args([*base, "--amqp-message-id-duplicates"])
    assert config_from_args(on).amqp_message_id_duplicates


def _connect(node: NodeProcess) -> BlockingConnection:
    return BlockingConnection(
        f"amqp://127.0.0.1:{node.amqp_port}", user="admin", password="admin", timeout=10
    )


def _drain(node: NodeProcess, address: str) -> list[str]:
    connection = _connect(node)
    try:
        receiver = connection.create_receiver(address, credit=COUNT + 10)
        bodies = []
        while True:
            try:
                message = receiver.receive(1.0)
            except Timeout:
                return bodies
            bodies.append(message.body)
            receiver.accept()
    finally:
        connection.close()


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_a_producer_that_reuses_message_ids_loses_nothing(tmp_path: Path) -> None:
    with BrokerPair(tmp_path / "pair", heartbeat_timeout=1.0) as pair:
        live = pair.live
        connection = _connect(live)
        try:
            sender = connection.create_sender("reused-ids")
            for i in range(COUNT):
                # Ids that repeat, of the types AMQP allows: ulong, string, binary.
                message_id = (i % 3, str(i % 3), str(i % 3).encode())[i % 3]
                sender.send(Message(body=f"m{i}", durable=True, id=message_id))
            # A real duplicate id still works: the resend is stored once.
            for _ in range(2):
                sender.send(
                    Message(body="dup", durable=True, id=1, properties={"_AMQ_DUPL_ID": "once"})
                )
        finally:
            connection.close()
        # Every message was confirmed: it survives the loss of the live.
        pair.kill(live)
        survivor = pair.wait_active(30)
        bodies = _drain(survivor, "reused-ids")
    assert bodies == [f"m{i}" for i in range(COUNT)] + ["dup"]
