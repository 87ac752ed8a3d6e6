"""A URL that names the live alone: the client learns the backup from the broker.

Run: python examples/announced_list.py [stomp|amqp] [add|replace]
(the bundled pair is started; AMQP by default). On AMQP the live announces its backup in
the ``failover-server-list`` open property, as ActiveMQ Artemis does; on STOMP in the pair's
topology header. ``failover_server_list`` says what the client does with it: ``add`` (the
default) adds it to the URL's list, ``replace`` keeps only the broker connected to and the
announced ones, ``ignore`` leaves the URL's list alone (and this example then ends without
a broker). The example sends, SIGKILLs the live, sends again: the sends after the kill wait
for the failover (F1) to the backup, which the URL never named.
"""

from __future__ import annotations

import sys
import tempfile

from _pair import OPTIONS

import hafailover
from reference_broker.pair import BrokerPair


def main(argv: list[str]) -> int:
    protocol = argv[1] if len(argv) > 1 else "amqp"
    action = argv[2] if len(argv) > 2 else "add"
    if protocol not in ("stomp", "amqp") or action not in ("add", "replace"):
        print(f"usage: {argv[0]} [stomp|amqp] [add|replace]", file=sys.stderr)
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="hafailover-example-") as tmp,
        BrokerPair(tmp, user="example", password="example") as pair,  # noqa: S106 - loopback
    ):
        pair.wait_synchronized(30)
        live = pair.live
        port = live.amqp_port if protocol == "amqp" else live.stomp_port
        url = (
            f"{protocol}://example:example@127.0.0.1:{port}?{OPTIONS}"
            f"&reconnect_attempts=-1&failover_server_list={action}"
        )
        print(f"the URL names one broker: {protocol}://127.0.0.1:{port}", flush=True)
        with hafailover.connect(url) as connection:
            producer = connection.create_session().create_producer("queue://example.announced")
            for seq in range(5):
                producer.send(f"before {seq}")
            pair.kill(live)
            print(f"killed the live ({live.name})", flush=True)
            for seq in range(5):
                producer.send(f"after {seq}")  # waits for the failover (F1)
            report = connection.reports[-1]
            print(f"failed over to {report.to_broker}, which the broker announced", flush=True)
            consumer = connection.create_session().create_consumer("queue://example.announced")
            connection.start()
            got = []
            while (message := consumer.receive(2.0)) is not None:
                got.append(message.text)
        print(f"received {len(got)} of 10 on the backup")
        return 0 if len(got) == 10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
