"""The client library against the raw clients, as ratios measured in one run.

Run: .venv/bin/python benchmarks/client.py [--quick] [--json]

Every figure is measured here, against a bundled pair (live + synchronized backup) that this
script starts and stops; throughput figures are ratios against the raw client measured in
the same run (best of --repeats, runs alternated so that both see the same machine):

1. STOMP, every send confirmed: ``producer.send_async`` over N persistent 1 KiB messages,
   then ``flush``, against raw stomp.py (``Connection12``, a receipt on each send, pipelined:
   receipts counted in a listener, then waited for). Target >= 1.0.
2. STOMP, unconfirmed: a ``confirm=False`` producer against raw stomp.py fire-and-forget;
   both end with one receipted frame so the broker has really taken every message.
   Target >= 0.9.
3. AMQP, every send confirmed: ``send_async`` + ``flush`` against proton's
   ``BlockingSender.send`` (which waits for each settlement). Target >= 10.
4. Failover time: SIGKILL of the live to the first confirmed send begun after the kill, over
   a failover URL with ``heartbeat=250ms`` (the other options at their defaults); the killed
   node is restarted as backup and synchronized between runs, so the live alternates.
   p50 <= 0.15 s (issue 18), p99 <= 2 s. Also printed: the failover reports' time from
   noticing the loss to the restored connection, and their attempts (the rest is the
   detection and the first send). ``--failover-only`` measures this alone.
5. Memory: resident memory while 1,000,000 unconfirmed sends meet a paused (SIGSTOP) live:
   the sender must stop at the confirmation window, and the growth must stay within the
   window plus a constant (MEMORY_CONSTANT). The live is then resumed and the rest of the
   sends go through while the peak is watched.
6. The paths applications use, each against the raw client doing the same (synchronous and
   pipelined confirmed sends, transactions of 1, 10 and 100, receives in every mode):
   benchmarks/paths.py, run last with the same --quick/--repeats unless --no-paths, its
   figures printed (or, with --json, included under "paths").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import proton
import stomp
from proton.utils import BlockingConnection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import hafailover  # noqa: E402
from reference_broker.pair import BrokerPair, NodeProcess  # noqa: E402

BODY = b"x" * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
# What the memory figure may exceed the confirmation window by: interpreter noise, stomp.py's
# and the allocator's buffers. The window holds ~1.1 KiB of accounted bytes per 1 KiB send.
MEMORY_CONSTANT = 8 * 1024 * 1024


def body(i: int) -> bytes:
    """A distinct 1 KiB body (no NUL byte: see docs/benchmarks.md)."""
    return BODY[:-16] + b"%016x" % i


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def destination() -> str:
    return f"bench-{time.monotonic_ns()}"


# --- raw clients -------------------------------------------------------------------------------


class Receipts(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.count = 0
        self.condition = threading.Condition()

    def on_receipt(self, frame: Any) -> None:
        with self.condition:
            self.count += 1
            self.condition.notify_all()

    def wait(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.condition:
            while self.count < count:
                if not self.condition.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"only {self.count} of {count} receipts")


def raw_stomp(port: int, messages: int, *, confirm: bool) -> float:
    """Persistent 1 KiB sends per second through one raw stomp.py connection."""
    connection = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0), auto_decode=False)
    listener = Receipts()
    connection.set_listener("bench", listener)
    connection.connect("admin", "admin", wait=True)
    queue = f"/queue/{destination()}"
    start = time.perf_counter()
    if confirm:
        for i in range(messages):
            connection.send(queue, BODY, headers={"persistent": "true", "receipt": str(i)})
        listener.wait(messages)
    else:
        for _ in range(messages - 1):
            connection.send(queue, BODY, headers={"persistent": "true"})
        connection.send(queue, BODY, headers={"persistent": "true", "receipt": "last"})
        listener.wait(1)
    elapsed = time.perf_counter() - start
    connection.disconnect()
    return messages / elapsed


def raw_amqp(port: int, messages: int) -> float:
    """Durable 1 KiB sends per second through proton's BlockingSender (one at a time)."""
    connection = BlockingConnection(
        f"amqp://127.0.0.1:{port}",
        user="admin",
        password="admin",
        allowed_mechs="PLAIN",
        allow_insecure_mechs=True,
        timeout=30,
    )
    sender = connection.create_sender(f"queue://{destination()}")
    start = time.perf_counter()
    for _ in range(messages):
        sender.send(proton.Message(body=BODY, durable=True))
    elapsed = time.perf_counter() - start
    connection.close()
    return messages / elapsed


# --- the library -------------------------------------------------------------------------------


def library(url: str, messages: int, *, confirm: bool) -> float:
    """The same workload through hafailover: send_async, then flush (or a last confirmed send)."""
    with hafailover.connect(url) as connection:
        session = connection.create_session()
        queue = f"queue://{destination()}"
        producer = session.create_producer(queue, confirm=confirm)
        last = session.create_producer(queue)
        start = time.perf_counter()
        if confirm:
            for _ in range(messages):
                producer.send_async(BODY)
            producer.flush()
        else:
            for _ in range(messages - 1):
                producer.send_async(BODY)
            last.send(BODY)  # a receipt: the broker has everything before it
        elapsed = time.perf_counter() - start
        stats = connection.statistics()
        assert stats.failovers == 0, stats
        return messages / elapsed


def best(repeats: int, ours: Callable[[], float], raw: Callable[[], float]) -> tuple[float, float]:
    """Best rate of each over ``repeats`` alternated runs."""
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(repeats):
        theirs.append(raw())
        mine.append(ours())
    return max(mine), max(theirs)


# --- failover time -----------------------------------------------------------------------------


@dataclasses.dataclass
class FailoverRuns:
    """Each kill's seconds to the first confirmed send, and what its failover report said:
    seconds from noticing the loss to the restored connection, and the attempts made."""

    times: list[float] = dataclasses.field(default_factory=list)
    reconnected: list[float] = dataclasses.field(default_factory=list)
    attempts: list[int] = dataclasses.field(default_factory=list)


def failover_times(tmp: Path, protocol: str, runs: int) -> FailoverRuns:
    """Seconds from SIGKILL of the live to the first confirmed send begun after it."""
    measured = FailoverRuns()
    directory = tmp / f"failover-{protocol}"
    with BrokerPair(directory, allow_failback=False, log_level="WARNING") as pair:
        url = pair.stomp_url if protocol == "stomp" else pair.amqp_url
        with hafailover.connect(f"{url}?heartbeat=250ms") as connection:
            producer = connection.create_session().create_producer(f"queue://{destination()}")
            for _ in range(runs):
                producer.send(BODY)  # connected to the current live, and confirmed
                live = pair.live
                start = time.monotonic()
                os.kill(live.pid, signal.SIGKILL)
                producer.send(BODY)
                measured.times.append(time.monotonic() - start)
                pair.kill(live)  # reap it
                pair.restart(live)  # it rejoins as backup (no failback): the live alternates
                pair.wait_synchronized(60)
            stats = connection.statistics()
            assert stats.failovers == runs, stats
            for report in connection.reports:
                measured.reconnected.append(report.duration)
                measured.attempts.append(report.attempts)
    return measured


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


# --- memory -----------------------------------------------------------------------------------


def memory(pair: BrokerPair, sends: int, pause: float) -> dict[str, Any]:
    """RSS while unconfirmed sends meet a paused live, then while the rest go through."""
    # No heart-beat and a long call timeout: the paused live must look slow, not dead, so
    # that the sender meets the window rather than a failover.
    url = f"{pair.stomp_url}?heartbeat=0&call_timeout=10m"
    with hafailover.connect(url) as connection:
        window = connection.policy.confirmation_window_size
        session = connection.create_session()
        queue = f"queue://{destination()}"
        producer = session.create_producer(queue, confirm=False)
        confirmed = session.create_producer(queue)
        # Warm up the code paths (not the window: its memory is part of what is measured).
        for i in range(100):
            producer.send_async(body(i))
        confirmed.send(BODY)  # a confirmed send: the broker has everything before it
        gc.collect()
        baseline = rss()
        held_before = connection._window.buffered_bytes
        live: NodeProcess = pair.live
        sent = 0
        failure: list[BaseException] = []

        def sender() -> None:
            nonlocal sent
            try:
                for i in range(sends):
                    # A fresh body each time, as an application's would be.
                    producer.send_async(body(i))
                    sent += 1
            except hafailover.HaFailoverError as exc:  # reported below
                failure.append(exc)

        pair.pause(live)
        paused = True
        try:
            thread = threading.Thread(target=sender, name="bench-sender", daemon=True)
            thread.start()
            # Wait until the sender stops moving.
            last, still_since = -1, time.monotonic()
            while time.monotonic() - still_since < 1.0:
                time.sleep(0.05)
                if sent != last:
                    last, still_since = sent, time.monotonic()
                if not thread.is_alive():
                    break
            blocked_at = sent
            held = connection._window.buffered_bytes  # what the window holds (accounting)
            peak_paused = rss()
            end = time.monotonic() + pause
            while time.monotonic() < end:
                peak_paused = max(peak_paused, rss())
                time.sleep(0.05)
            still_blocked = sent == blocked_at
            pair.resume(live)
            paused = False
            start = time.monotonic()
            peak_after = rss()
            while thread.is_alive():
                peak_after = max(peak_after, rss())
                thread.join(0.05)
            confirmed.send(BODY)
            drained = time.monotonic() - start
        finally:
            if paused:
                pair.resume(live)
        if failure:
            raise failure[0]
        failovers = connection.statistics().failovers
    growth_paused = peak_paused - baseline
    growth_all = max(peak_paused, peak_after) - baseline
    return {
        "window_bytes": window,
        "sends": sends,
        "sends_before_blocking": blocked_at,
        "window_held_bytes": held,
        "window_held_before_bytes": held_before,
        "still_blocked_after_s": pause if still_blocked else 0.0,
        "rss_baseline_bytes": baseline,
        "rss_growth_paused_bytes": growth_paused,
        "rss_growth_whole_run_bytes": growth_all,
        "rss_max_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rest_after_resume_s": drained,
        "limit_bytes": window + MEMORY_CONSTANT,
        "failovers": failovers,
    }


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and runs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--messages", type=int, help="STOMP messages per run (20,000)")
    parser.add_argument("--amqp-messages", type=int, help="AMQP messages per run (5,000)")
    parser.add_argument("--repeats", type=int, help="alternated runs, best kept (3)")
    parser.add_argument("--failover-runs", type=int, help="kills per protocol (20)")
    parser.add_argument("--memory-sends", type=int, help="sends in the memory run (1,000,000)")
    parser.add_argument(
        "--no-paths", action="store_true", help="leave out benchmarks/paths.py's figures"
    )
    parser.add_argument(
        "--failover-only",
        action="store_true",
        help="only the failover figures (4), measured as in a full run; implies --no-paths",
    )
    args = parser.parse_args()
    quick = args.quick
    messages = args.messages or (5_000 if quick else 20_000)
    amqp_messages = args.amqp_messages or (1_000 if quick else 5_000)
    repeats = args.repeats or (1 if quick else 3)
    runs = args.failover_runs or (5 if quick else 20)
    sends = args.memory_sends or (100_000 if quick else 1_000_000)

    figures: dict[str, Any] = {
        "stomp_messages": messages,
        "amqp_messages": amqp_messages,
        "repeats": repeats,
    }
    rows: list[tuple[str, str, str, bool | None]] = []  # None: no target
    with tempfile.TemporaryDirectory() as tmp:
        if not args.failover_only:
            # Throughput and memory: a pair whose backup never takes over while the live is
            # paused for the memory run (a long heart-beat timeout and lease).
            with BrokerPair(Path(tmp) / "pair", heartbeat_timeout=60, log_level="WARNING") as pair:
                live = pair.live
                stomp_url = f"{pair.stomp_url}"
                amqp_url = f"{pair.amqp_url}"

                # (label, raw side's name, figure keys, ours, raw, ratio's format, target)
                throughput = (
                    (
                        "STOMP confirmed",
                        "raw",
                        ("stomp_confirmed", "stomp_confirmed_raw"),
                        lambda: library(stomp_url, messages, confirm=True),
                        lambda: raw_stomp(live.stomp_port, messages, confirm=True),
                        ".2f",
                        1.0,
                    ),
                    (
                        "STOMP unconfirmed",
                        "raw",
                        ("stomp_unconfirmed", "stomp_unconfirmed_raw"),
                        lambda: library(stomp_url, messages, confirm=False),
                        lambda: raw_stomp(live.stomp_port, messages, confirm=False),
                        ".2f",
                        0.9,
                    ),
                    (
                        "AMQP confirmed",
                        "BlockingSender",
                        ("amqp_confirmed", "amqp_confirmed_blocking"),
                        lambda: library(amqp_url, amqp_messages, confirm=True),
                        lambda: raw_amqp(live.amqp_port, amqp_messages),
                        ".1f",
                        10,
                    ),
                )
                for label, raw_name, keys, run_ours, run_raw, shown, target in throughput:
                    ours, raw = best(repeats, run_ours, run_raw)
                    figures.update({keys[0]: ours, keys[1]: raw})
                    ratio = ours / raw
                    rows.append(
                        (
                            f"{label}: {ours:,.0f} vs {raw_name} {raw:,.0f} msg/s",
                            f"{ratio:{shown}}",
                            f">= {target}",
                            ratio >= target,
                        )
                    )

                mem = memory(pair, sends, pause=2.0 if quick else 5.0)
                figures["memory"] = mem
                growth = mem["rss_growth_paused_bytes"]
                whole = mem["rss_growth_whole_run_bytes"]
                limit = mem["limit_bytes"]
                blocked = mem["still_blocked_after_s"] > 0
                rows.append(
                    (
                        "memory, paused live: blocked after "
                        f"{mem['sends_before_blocking']:,} sends "
                        f"({mem['window_held_bytes'] / 2**20:.2f} MiB in the window), RSS growth",
                        f"{growth / 2**20:.1f} MiB",
                        f"<= {limit / 2**20:.0f} MiB",
                        blocked and growth <= limit and mem["failovers"] == 0,
                    )
                )
                rows.append(
                    (
                        f"memory, all {sends:,} sends (resumed, {mem['failovers']} failovers): "
                        "peak RSS growth",
                        f"{whole / 2**20:.1f} MiB",
                        f"<= {limit / 2**20:.0f} MiB",
                        whole <= limit and mem["failovers"] == 0,
                    )
                )

        for protocol in ("stomp", "amqp"):
            measured = failover_times(Path(tmp), protocol, runs)
            times = measured.times
            p50, p99 = percentile(times, 50), percentile(times, 99)
            figures[f"failover_{protocol}_s"] = times
            figures[f"failover_{protocol}_p50_s"] = p50
            figures[f"failover_{protocol}_p99_s"] = p99
            figures[f"failover_{protocol}_reconnected_s"] = measured.reconnected
            figures[f"failover_{protocol}_attempts"] = measured.attempts
            name = protocol.upper()
            rows.append(
                (f"{name} failover, {runs} kills: p50", f"{p50:.2f} s", "<= 0.15 s", p50 <= 0.15)
            )
            rows.append((f"{name} failover, {runs} kills: p99", f"{p99:.2f} s", "<= 2 s", p99 <= 2))
            reconnected = percentile(measured.reconnected, 50)
            attempts = percentile([float(a) for a in measured.attempts], 50)
            rows.append(
                (
                    f"{name} failover: loss noticed to reconnected, p50 ({attempts:.0f} attempts)",
                    f"{reconnected:.2f} s",
                    "",
                    None,
                )
            )

    figures["load_average"] = os.getloadavg()
    paths = [] if args.no_paths or args.failover_only else paths_command(args)
    if args.json:
        if paths:
            run = subprocess.run([*paths, "--json"], check=True, capture_output=True, text=True)
            figures["paths"] = json.loads(run.stdout)
        print(json.dumps(figures, indent=2))
        return
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>10}  {'target':>10}")
    for label, value, target, ok in rows:
        verdict = "" if ok is None else "PASS" if ok else "FAIL"
        print(f"{label:<{width}}  {value:>10}  {target:>10}  {verdict}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if paths:
        print(flush=True)
        subprocess.run(paths, check=True)


def paths_command(args: argparse.Namespace) -> list[str]:
    """benchmarks/paths.py with this run's --quick and --repeats (its own pair, its own run)."""
    command = [sys.executable, str(Path(__file__).with_name("paths.py"))]
    if args.quick:
        command.append("--quick")
    if args.repeats:
        command += ["--repeats", str(args.repeats)]
    return command


if __name__ == "__main__":
    main()
