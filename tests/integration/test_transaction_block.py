"""``session.transaction(retries=N)`` through a SIGKILL of the live: the block that the
failover rolled back runs again with the same messages and commits; each arrives once."""

from __future__ import annotations

import pytest

import hafailover
from hafailover import AckMode, Message
from reference_broker import BrokerPair

from .support import drain, seqs, url_for, wait_until

pytestmark = pytest.mark.timeout(90)


def test_a_block_rolled_back_by_a_sigkill_runs_again_and_commits_once(
    pair: BrokerPair, protocol: str
) -> None:
    url = url_for(pair, protocol, reconnect_attempts=-1)
    with hafailover.connect(url) as connection:
        assert connection.broker_detects_duplicates  # the bundled pair drops copies (F13)
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer("queue://tx-block")
        batches = [[Message(body="m", properties={"seq": b * 10 + n}) for n in range(10)]
                   for b in range(3)]  # fmt: skip
        attempts = []
        for number, batch in enumerate(batches):
            for attempt in session.transaction(retries=5):
                with attempt:
                    attempts.append((number, attempt.number))
                    for message in batch:
                        producer.send(message)
                    if number == 1 and attempt.number == 1:
                        pair.kill(pair.live)  # the transaction dies with the live
                        wait_until(
                            lambda: connection.statistics().failovers == 1, 30, "the failover"
                        )
        assert (1, 2) in attempts  # the second batch ran again
        assert connection.reports[0].transactions_rolled_back
    received = seqs(drain(url, "queue://tx-block"))
    assert sorted(received) == list(range(30))
