"""The transacted retry loop: a batch that a failover rolled back is sent again and committed.

Run: python examples/transacted_retry.py [FAILOVER_URL] [BATCHES]
(no URL: the bundled pair). Kill the live broker while it runs to see a retry.

After a failover a transaction with work in it is rollback-only (F9): commit() rolls it
back and raises TransactionRolledBackError. The application sends the same Message objects
again: they keep their ids, which are their duplicate ids (F13), so a broker with duplicate
detection stores each once even if the first attempt's fate was unknown.
"""

from __future__ import annotations

import sys
import time

from _pair import failover_url

import hafailover
from hafailover import (
    AckMode,
    Message,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
)

BATCH = 10
QUEUE = "queue://example.orders"


def send_batch(
    session: hafailover.Session, producer: hafailover.Producer, batch: list[Message]
) -> int:
    """Send and commit one batch until it commits; returns the attempts it took."""
    for attempt in range(1, 11):
        try:
            for message in batch:
                producer.send(message)  # transacted: completes at once, commit confirms
            session.commit()
        except TransactionRolledBackError:
            print(f"  rolled back by a failover: sending the same {len(batch)} again", flush=True)
        except TransactionOutcomeUnknownError:
            print("  commit outcome unknown: sending the same ids again is safe", flush=True)
        else:
            return attempt
    raise RuntimeError("the batch did not commit in 10 attempts")


def main(argv: list[str]) -> int:
    batches = int(argv[2]) if len(argv) > 2 else 20
    with failover_url(argv) as url, hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer(QUEUE)
        retried = 0
        for number in range(batches):
            batch = [
                Message(body=f"order {seq}", properties={"seq": seq})
                for seq in range(number * BATCH, (number + 1) * BATCH)
            ]
            retried += send_batch(session, producer, batch) - 1
            print(f"batch {number} committed", flush=True)
            time.sleep(0.05)

        # Check: every order stored exactly once.
        consumer = connection.create_session(AckMode.AUTO).create_consumer(QUEUE)
        connection.start()
        seqs = []
        while (message := consumer.receive(timeout=2.0)) is not None:
            seqs.append(int(message.properties["seq"]))
        expected = set(range(batches * BATCH))
        lost, duplicated = expected - set(seqs), len(seqs) - len(set(seqs))
        print(
            f"committed {batches} batches ({retried} retried, "
            f"{connection.statistics().failovers} failover(s)); received {len(seqs)}: "
            f"lost {len(lost)}, duplicated {duplicated}"
        )
        return 0 if not lost and not duplicated else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
