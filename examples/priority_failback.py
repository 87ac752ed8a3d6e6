"""Priority failback: back to the preferred broker once it answers (failover_method=priority).

Run: python examples/priority_failback.py [FAILOVER_URL]
Given a URL (``failover:(preferred,other)?failover_method=priority&failback_interval=1s``),
it sends for 30 seconds and prints every failover; stop and start the preferred broker
meanwhile. With no URL it starts two bundled brokers (no backups), stops the preferred one,
starts it again, and shows the client moving back, told as a failover with
``report.failback`` set.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time

from _pair import OPTIONS

import hafailover
from hafailover import FailoverNotice, HaFailoverError

moved_back = threading.Event()


def on_exception(error: HaFailoverError) -> None:
    if isinstance(error, FailoverNotice):
        kind = "failback" if error.report.failback else "failover"
        print(f"{kind}: {error.report.from_broker} -> {error.report.to_broker}", flush=True)
        if error.report.failback:
            moved_back.set()


def send_for(url: str, seconds: float, during: object = None) -> int:
    with hafailover.connect(url, exception_listener=on_exception) as connection:
        producer = connection.create_session().create_producer("queue://example.priority")
        if during is not None:
            threading.Thread(target=during, daemon=True).start()
        sent = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (during is not None and moved_back.is_set()):
            producer.send(f"tick {sent}")  # waits through each move (F1)
            sent += 1
            time.sleep(0.01)
        print(f"sent {sent}, now on {connection.broker}", flush=True)
        return sent


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        send_for(argv[1], 30.0)
        return 0
    from reference_broker.pair import BrokerPair, free_ports

    ports = free_ports(12)  # at once: each pair's unstarted backup ports stay its own
    with (
        tempfile.TemporaryDirectory(prefix="hafailover-example-") as tmp,
        BrokerPair(f"{tmp}/a", start_backup=False, ports=(*ports[:6],)) as preferred,  # type: ignore[arg-type]
        BrokerPair(f"{tmp}/b", start_backup=False, ports=(*ports[6:],)) as other,  # type: ignore[arg-type]
    ):
        for pair in (preferred, other):
            pair.wait_active(30)
        brokers = ",".join(
            f"stomp://admin:admin@127.0.0.1:{p.live.stomp_port}" for p in (preferred, other)
        )
        url = f"failover:({brokers})?{OPTIONS}&failover_method=priority&failback_interval=300ms"

        def outage() -> None:
            time.sleep(0.5)
            print("stopping the preferred broker", flush=True)
            preferred.kill(preferred.live)
            time.sleep(1.5)
            print("starting it again", flush=True)
            preferred.restart(preferred.live)

        send_for(url, 30.0, outage)
        return 0 if moved_back.is_set() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
