"""Shared by the examples: the failover URL from the command line, or a bundled pair.

``python examples/X.py 'failover:(stomp://h1:61613,stomp://h2:61613)?heartbeat=1s'`` uses
your brokers; with no argument the example starts the bundled live + backup pair in a
temporary directory and stops it at the end.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

# Quick detection and retry, so a failover shows within a second.
OPTIONS = "heartbeat=250ms&retry_interval=50ms&max_retry_interval=500ms"


@contextlib.contextmanager
def failover_url(argv: list[str], protocol: str = "stomp") -> Iterator[str]:
    if len(argv) > 1:
        yield argv[1]
        return
    from reference_broker.pair import BrokerPair

    with (
        tempfile.TemporaryDirectory(prefix="hafailover-example-") as tmp,
        BrokerPair(tmp, user="example", password="example") as pair,  # noqa: S106 - loopback
    ):
        url = pair.stomp_url if protocol == "stomp" else pair.amqp_url
        print(f"started the bundled pair: {url.replace('example:example@', '')}", flush=True)
        yield f"{url}?{OPTIONS}"
