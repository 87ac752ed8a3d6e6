"""The total-queue checker tells a message the pair dead-lettered from one it lost: a long
chaos run over AMQP dead-letters messages by the pair's poison rule (docs/reliability.md),
and counting those as lost hid where they were."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import hafailover
from hafailover import AckMode, Message
from reference_broker import BrokerPair

from .clients import check

pytestmark = pytest.mark.timeout(120)


@attrs.define
class _Sent:
    attempted: set[int]
    confirmed: list[int]
    failovers: int = 0
    longest_stall: float = 0.0


@attrs.define
class _Taken:
    handed: list[int]
    acknowledged: list[int]
    in_doubt: list[int] = attrs.field(factory=list)
    failovers: int = 0
    longest_stall: float = 0.0


def test_dead_lettered_messages_are_counted_apart_from_lost_ones(tmp_path: Path) -> None:
    queue = "queue://checked"
    with BrokerPair(tmp_path / "pair", node_options=["--max-delivery-attempts", "1"]) as pair:
        pair.wait_synchronized(30)
        url = pair.stomp_url
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.CLIENT_INDIVIDUAL)
            producer = session.create_producer(queue)
            for seq in range(2):
                producer.send(Message(body=f"m{seq}", properties={"seq": seq}))
            consumer = session.create_consumer(queue, prefetch=1)
            connection.start()
            first = consumer.receive(10)
            assert first is not None
            first.acknowledge()  # seq 0: taken by the application
            second = consumer.receive(10)
            assert second is not None
            second.release()  # seq 1: one failed delivery is the limit: dead-lettered
            consumer.close()
            # seq 2 stays on the queue, for the drain: sent after the close, so that no
            # consumer held it (a close gives what it held back as a failed delivery too).
            producer.send(Message(body="m2", properties={"seq": 2}))
        # seq 3 "confirmed" but never sent: what the broker does not have is lost.
        verdict = check(url, queue, [_Sent({0, 1, 2, 3}, [0, 1, 2, 3])], [_Taken([0, 1], [0])])
    assert verdict.drained == 1
    assert verdict.dead_lettered == [1]
    assert verdict.lost == [3]
    assert "dead-lettered=1" in verdict.line("checker", "stomp")
    with pytest.raises(AssertionError, match="lost"):
        verdict.assert_clean(dead_letters_allowed=True)
    clean = attrs.evolve(verdict, lost=[])
    with pytest.raises(AssertionError, match="dead-lettered"):
        clean.assert_clean()
    clean.assert_clean(dead_letters_allowed=True)
