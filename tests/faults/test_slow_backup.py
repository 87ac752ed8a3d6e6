"""Issue 18, scenario g: a slow backup, paused again and again for less than the heartbeat
timeout while clients keep the live busy.

Replication is synchronous: while the backup is stopped (SIGSTOP), nothing the live writes
can be confirmed, so confirmations wait for it; they must not go out without it (the live
stays synchronous, never degraded, as the pause is shorter than the heartbeat timeout), no
client fails over, nothing is lost, and the live's memory stays bounded.

Why it is bounded: what the live holds for a paused backup is what it wrote and could not
send (the replication socket's buffers, then its transport's write buffer), and what it
wrote is only what clients sent and have not had confirmed. Every client here has a bounded
number of unconfirmed sends (the confirmed producer one, the pipelined producer
PIPELINE), so the backlog of one pause is at most PIPELINE + 1 messages of 2 KiB, about
0.4 MiB, written out and freed once the backup resumes. So the rise of the live's RSS
within one pause is bounded by PAUSE_GROWTH (8 MiB: that backlog, its records and frames,
and the allocator's slack); a live that held more per pause (records kept for the backup
past their acknowledgement, sends accepted without limit while confirmations wait) would
rise by tens of MiB a pause under this load. Over the whole run the RSS also grows with
the queue itself (the consumer is slower than the two producers, and stored messages live
in memory): TOTAL_GROWTH (16 MiB) plus PER_STORED_MESSAGE (6 KiB) for each message stored
at the deepest point of the queue, seen while sampling (sends confirmed, or waiting for
their confirmation, and not yet acknowledged) or at the end, bounds both. 4 KiB a message
was too tight over AMQP 1.0: growth 32.0 MiB with 4,378 stored on a quiet machine (bound
33), 37.8 MiB with 5,052 in a full run (bound 36, failed); over STOMP 34.5 MiB with 12,376.
Over AMQP 1.0 a live that kept every message past its acknowledgement (about twice as many
sent as stored) goes over it; over STOMP, where a stored message costs less than 3 KiB, the
whole-run bound is loose, and the bound within a pause is the one that catches a live
holding what it should have freed.

A checkpoint is the exception, and is allowed for: the live writes its whole state into the
journal at once when the journal has grown enough (reference_broker/node.py), and holds it,
encoded for the journal and for the backup, until the backup has it, so a checkpoint taken
while the backup is paused raises the RSS by a few times the checkpoint's size (95.5 MiB
for a 44.4 MB checkpoint, STOMP, in a full run; most runs take none). From the checkpoints
the live's log reports, CHECKPOINT_HOLD times the largest one overlapping a pause is added
to that pause's bound, and the largest overlapping the sampling to the whole run's.

The clients' heart-beat is 1 s, not the integration tests' 250 ms: on a loaded two-core
machine a client thread starved for half a second otherwise reads as a dead live.
"""

from __future__ import annotations

import collections
import datetime
import re
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

import hafailover
from hafailover import HaFailoverError, Message
from reference_broker import BrokerPair
from tests.integration.support import AckingConsumer, url_for, wait_until

from .clients import ConfirmedProducer, base_url, check, stop_all

pytestmark = pytest.mark.timeout(120)

QUEUE = "queue://slow-backup"
PAUSES = 8
PAUSED_FOR = 0.5  # seconds; the heartbeat timeout is 1.0 s
RESUMED_FOR = 0.3
PIPELINE = 100  # sends the pipelined producer leaves unconfirmed at most
BODY = b"p" * 2048
PAUSE_GROWTH = 8 * 1024 * 1024  # bytes the live's RSS may rise within one pause
# What the RSS may grow over its warm level in the whole run: a fixed allowance, and 6 KiB
# for each message stored at the queue's deepest (the load's 2 KiB bodies, and every
# message's objects and records).
TOTAL_GROWTH = 16 * 1024 * 1024
PER_STORED_MESSAGE = 6 * 1024
# What a checkpoint in flight may add, in times its size: its records, and their encodings
# for the journal and for the backup (2.25 measured: 95.5 MiB for 44.4 MB).
CHECKPOINT_HOLD = 3
_CHECKPOINT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* checkpoint \d+: (\d+) bytes at seq \d+ in "
    r"([\d.]+)s"
)


@pytest.fixture(params=["stomp", "amqp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[BrokerPair]:
    with BrokerPair(tmp_path / "pair", user="app", password="secret") as started:
        started.wait_synchronized(30)
        yield started


def checkpoints(log: Path) -> list[tuple[float, float, int]]:
    """The checkpoints a node's log reports: (began, ended) by the wall clock, and bytes.
    It logs one once written and compacted: it began at most its writing time earlier."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = _CHECKPOINT_LINE.match(line)
        if match is not None:
            stamp, size, written = match.groups()
            ended = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((ended - float(written), ended, int(size)))
    return found


def largest_overlapping(taken: list[tuple[float, float, int]], start: float, end: float) -> int:
    """The size of the largest checkpoint that overlapped ``start``-``end`` (wall clock), a
    second either side, or 0."""
    return max(
        (size for began, ended, size in taken if began - 1 < end and ended + 1 > start), default=0
    )


def rss(pid: int) -> int:
    """Resident set size of a process, in bytes, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class PipelinedProducer(threading.Thread):
    """Load: persistent sends through the confirmation window, at most PIPELINE of them
    unconfirmed; its seqs start at 10**6 so they never meet the confirmed producer's."""

    def __init__(self, url: str) -> None:
        super().__init__(name="pipelined-producer", daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.attempted: set[int] = set()
        self.confirmed: list[int] = []
        self.in_doubt: list[int] = []
        self.failovers = 0
        self.longest_stall = 0.0  # not measured: its sends are pipelined
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                producer = connection.create_session().create_producer(QUEUE)
                pending: collections.deque[tuple[int, object]] = collections.deque()
                seq = 10**6
                while not self.stop.is_set() or pending:
                    if not self.stop.is_set() and len(pending) < PIPELINE:
                        message = Message(body=BODY, properties={"seq": seq})
                        self.attempted.add(seq)
                        pending.append((seq, producer.send_async(message)))
                        seq += 1
                        continue
                    done, completion = pending.popleft()
                    try:
                        completion.result(30)  # type: ignore[attr-defined]
                    except HaFailoverError:
                        self.in_doubt.append(done)
                    else:
                        self.confirmed.append(done)
                self.failovers = connection.statistics().failovers
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()


def test_a_backup_paused_again_and_again_holds_confirmations_back_and_loses_nothing(
    pair: BrokerPair, protocol: str
) -> None:
    url = url_for(pair, protocol, heartbeat="1s")
    live, backup = pair.live, pair.backup
    producer = ConfirmedProducer(url, QUEUE)
    load = PipelinedProducer(url)
    consumer = AckingConsumer(url, QUEUE)
    for thread in (producer, load, consumer):
        thread.start()
    samples: list[int] = []
    depths: list[int] = []  # messages stored, at most, when each sample was taken

    def sample() -> int:
        confirmed_or_pending = len(producer.confirmed) + 1 + len(load.confirmed) + PIPELINE
        depths.append(max(0, confirmed_or_pending - len(consumer.acknowledged)))
        return rss(live.pid)

    pause_rises: list[int] = []
    paused: list[tuple[float, float]] = []  # (stopped, resumed) by the monotonic clock
    paused_wall: list[tuple[float, float]] = []  # the same by the wall clock (the logs')
    degraded_seen = False
    try:
        wait_until(lambda: len(load.confirmed) >= 2 * PIPELINE, 30, "the load to run")
        warm, sampled_from = rss(live.pid), time.time()
        for _ in range(PAUSES):
            before = sample()
            pair.pause(backup)
            stopped, stopped_wall = time.monotonic(), time.time()
            paused_until = stopped + PAUSED_FOR
            during = [before]
            while time.monotonic() < paused_until:
                during.append(sample())
                time.sleep(0.05)
            pair.resume(backup)
            paused.append((stopped, time.monotonic()))
            paused_wall.append((stopped_wall, time.time()))
            samples += during
            pause_rises.append(max(during) - before)
            resumed_until = time.monotonic() + RESUMED_FOR
            while time.monotonic() < resumed_until:
                samples.append(sample())
                degraded_seen = degraded_seen or bool(live.status().get("degraded"))
                time.sleep(0.05)
        sampled_to = time.time()
        confirmed = len(load.confirmed)
        wait_until(lambda: len(load.confirmed) > confirmed + PIPELINE, 20, "load after pauses")
        degraded_seen = degraded_seen or bool(live.status().get("degraded"))
    finally:
        if backup.running:
            pair.resume(backup)
        load.stop.set()
        load.join(60)
        stop_all(producer, consumer)
    assert not load.is_alive() and load.error is None, load.error
    outcome = check(base_url(pair, protocol), QUEUE, [producer, load], [consumer])
    growth = max(samples) - warm
    stored = max(outcome.drained, *depths)  # the deepest the queue was seen, or the end
    taken = checkpoints(live.log_path)
    # The largest checkpoint the samples may have seen, and one overlapping each pause.
    held = CHECKPOINT_HOLD * largest_overlapping(taken, sampled_from, sampled_to)
    bound = TOTAL_GROWTH + PER_STORED_MESSAGE * stored + held
    pause_bounds = [
        PAUSE_GROWTH + CHECKPOINT_HOLD * largest_overlapping(taken, stopped, resumed)
        for stopped, resumed in paused_wall
    ]
    print(
        f"\n{outcome.line(f'backup paused {PAUSES}x{PAUSED_FOR}s', protocol)}"
        f" load confirmed={len(load.confirmed)} in doubt={len(load.in_doubt)}"
        f" live RSS warm={warm / 2**20:.1f} MiB max={max(samples) / 2**20:.1f} MiB"
        f" growth={growth / 2**20:.1f} MiB"
        f" (bound {bound / 2**20:.0f} MiB for {stored} stored at most),"
        f" largest rise within a pause {max(pause_rises) / 2**20:.2f} MiB"
        f" (bound {PAUSE_GROWTH / 2**20:.0f} MiB"
        f" + {CHECKPOINT_HOLD} x a checkpoint overlapping it)"
        f" checkpoints {[(round(e - b, 2), size) for b, e, size in taken]}"
        f" longest confirmed send {producer.longest_stall:.2f}s"
    )
    outcome.assert_clean()
    # Confirmations waited for the paused backup: no send begun while it was stopped was
    # confirmed before it resumed (one begun earlier may have reached it in time).
    early = [
        (round(begun - a, 3), round(at - a, 3))
        for begun, at in zip(producer.started_at, producer.confirmed_at, strict=True)
        for a, b in paused
        if a <= begun and at <= b
    ]
    assert early == [], f"confirmed while the backup was stopped (begun, confirmed): {early}"
    assert not degraded_seen, "the live dropped a backup paused for less than the heartbeat"
    assert outcome.failovers == 0
    over = [
        (i, rise, limit)
        for i, (rise, limit) in enumerate(zip(pause_rises, pause_bounds, strict=True))
        if rise >= limit
    ]
    assert over == [], f"pauses whose rise passed their bound (pause, rise, bound): {over}"
    assert growth < bound
