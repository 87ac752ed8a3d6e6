"""Decide under the lock, write outside it (issue 17): the outbox and the condition that
flushes it once the lock is let go (docs/core.md, "Decide under the lock, write outside it")."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from hafailover.driver.calls import WatchedCondition
from hafailover.protocols.outbox import Outbox

pytestmark = pytest.mark.timeout(30)


def test_a_flush_queued_under_the_lock_runs_once_the_outermost_hold_ends() -> None:
    cond = WatchedCondition()
    held_while_flushing: list[bool] = []

    def flush() -> None:
        held_while_flushing.append(cond._is_owned())  # type: ignore[attr-defined]

    with cond:
        with cond:
            cond.flush_later(flush)
            cond.flush_later(flush)  # the same flush once per hold
        assert held_while_flushing == []  # a nested hold still holds the lock
    assert held_while_flushing == [False]


def test_a_flush_asked_for_without_the_lock_runs_at_once() -> None:
    cond = WatchedCondition()
    ran: list[int] = []
    cond.flush_later(lambda: ran.append(1))
    assert ran == [1]


def test_waiting_on_the_condition_flushes_first_with_the_lock_let_go() -> None:
    cond = WatchedCondition()
    seen: list[bool] = []
    with cond:
        cond.flush_later(lambda: seen.append(cond._is_owned()))  # type: ignore[attr-defined]
        cond.wait(0.01)
        assert seen == [False]
        assert cond._is_owned()  # type: ignore[attr-defined]  # held again after the wait
    assert seen == [False]  # not run a second time


def test_another_thread_can_take_the_lock_while_a_flush_blocks() -> None:
    cond = WatchedCondition()
    release = threading.Event()
    entered = threading.Event()

    def stuck_write() -> None:
        entered.set()
        release.wait(10)

    def writer() -> None:
        with cond:
            cond.flush_later(stuck_write)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert entered.wait(5)
    got = cond.acquire(timeout=5)  # the reader's turn: the writer holds no lock now
    assert got
    cond.release()
    release.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_flush_never_waits_for_a_stuck_writer_and_its_bytes_follow_in_order() -> None:
    written: list[bytes] = []
    first = threading.Event()
    release = threading.Event()

    def write(data: bytes) -> None:
        if not first.is_set():
            first.set()
            release.wait(10)  # a peer that stops reading
        written.append(data)

    outbox = Outbox(write, lambda error: None)
    outbox.put(b"big")
    stuck = threading.Thread(target=outbox.flush, daemon=True)
    stuck.start()
    assert first.wait(5)
    assert outbox.writing
    outbox.put(b"ack-1")
    outbox.put(b"ack-2")
    other = threading.Thread(target=outbox.flush, daemon=True)
    other.start()
    other.join(5)
    assert not other.is_alive(), "a flush waited behind the stuck writer"
    assert written == []
    release.set()
    stuck.join(5)
    assert not stuck.is_alive()
    assert written == [b"big", b"ack-1ack-2"]  # the writer wrote them too, in order
    assert not outbox.pending


def test_a_failed_write_is_reported_once_and_what_follows_is_dropped() -> None:
    failures: list[Exception] = []
    attempts: list[bytes] = []

    def write(data: bytes) -> None:
        attempts.append(data)
        raise BrokenPipeError(32, "Broken pipe")

    outbox = Outbox(write, failures.append)
    outbox.put(b"one")
    outbox.flush()
    outbox.put(b"two")
    outbox.flush()
    assert attempts == [b"one"]
    assert len(failures) == 1 and isinstance(failures[0], BrokenPipeError)
    assert not outbox.pending


def test_a_heart_beat_never_blocks_on_a_full_socket_nor_behind_a_writer() -> None:
    """stomp.py's heart-beat thread also watches the broker's heart-beats: it must never
    block, whether the socket is full or another thread is stuck writing."""
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with contextlib.suppress(BlockingIOError):
        while True:  # a peer that stops reading: fill the buffers
            ours.send(b"x" * 4096, socket.MSG_DONTWAIT)
    try:
        outbox = Outbox(ours.sendall, lambda error: None)

        def write_now(data: bytes) -> bool:
            try:
                return ours.send(data, socket.MSG_DONTWAIT) == len(data)
            except BlockingIOError:
                return False

        beat = threading.Thread(target=outbox.offer, args=(b"\n", write_now), daemon=True)
        beat.start()
        beat.join(5)
        assert not beat.is_alive(), "a heart-beat blocked on a full socket"
        assert not outbox.pending  # dropped: a full socket is not an idle one
    finally:
        ours.close()
        peer.close()


def test_a_heart_beat_offered_while_another_thread_writes_follows_its_bytes() -> None:
    written: list[bytes] = []
    first = threading.Event()
    release = threading.Event()

    def write(data: bytes) -> None:
        if not first.is_set():
            first.set()
            release.wait(10)
        written.append(data)

    outbox = Outbox(write, lambda error: None)
    outbox.put(b"SEND")
    stuck = threading.Thread(target=outbox.flush, daemon=True)
    stuck.start()
    assert first.wait(5)
    offered: list[bytes] = []
    outbox.offer(b"\n", lambda data: offered.append(data) is None)
    assert offered == []  # not written past the writer: queued behind it
    release.set()
    stuck.join(5)
    assert written == [b"SEND", b"\n"]


def test_a_heart_beat_on_an_idle_outbox_is_written_at_once() -> None:
    outbox = Outbox(lambda data: None, lambda error: None)
    offered: list[bytes] = []
    outbox.offer(b"\n", lambda data: offered.append(data) is None)
    assert offered == [b"\n"]
    assert not outbox.pending


def test_a_flush_that_may_not_wait_leaves_the_rest_first_in_line() -> None:
    """The AMQP reader never blocks in a write: what the socket does not take now stays
    first in the outbox, even half a frame, and leaves before anything queued later."""
    written: list[bytes] = []
    room = [3]

    def write_some(data: bytes | memoryview) -> int:
        taken = bytes(data[: room[0]])
        room[0] = 0
        written.append(taken)
        return len(taken)

    outbox = Outbox(lambda data: written.append(bytes(data)), lambda error: None, write_some)
    outbox.put(b"FRAME-1")
    outbox.flush(wait=False)
    assert written == [b"FRA"] and outbox.pending
    outbox.put(b"FRAME-2")
    outbox.flush()  # a writer that may wait
    assert b"".join(written) == b"FRAME-1FRAME-2"
    assert not outbox.pending


def test_a_writer_that_may_block_takes_over_from_one_that_never_does() -> None:
    """The AMQP reader holds the write lock only for writes that never block; a thread
    flushing what it queued meanwhile waits for it and writes the rest itself, instead of
    leaving it for whichever thread flushes next (a consumer's acknowledge, say)."""
    holding = threading.Event()
    go = threading.Event()
    written: list[bytes] = []

    def write_some(data: bytes | memoryview) -> int:
        holding.set()
        go.wait(5)
        written.append(bytes(data[:2]))
        return 2

    outbox = Outbox(lambda data: written.append(bytes(data)), lambda error: None, write_some)
    outbox.put(b"AB")
    reader = threading.Thread(target=outbox.flush, kwargs={"wait": False}, daemon=True)
    reader.start()
    assert holding.wait(5)
    outbox.put(b"BIG-SEND")
    producer = threading.Thread(target=outbox.flush, daemon=True)
    producer.start()
    time.sleep(0.01)  # the producer finds the lock taken
    go.set()
    reader.join(5)
    producer.join(5)
    assert b"".join(written) == b"ABBIG-SEND"
    assert not outbox.pending


def test_bytes_left_to_a_heart_beat_are_written_without_blocking_it() -> None:
    """A writer that gave up waiting for the lock a heart-beat held leaves its bytes to the
    heart-beat's thread, which must neither block on them (a full socket would stop it
    checking the broker's heart-beats) nor strand them."""
    outbox = Outbox(lambda data: None, lambda error: None)
    in_write = threading.Event()
    may_finish = threading.Event()

    def slow_write_now(data: bytes) -> bool:  # the heart-beat's thread, descheduled mid-write
        in_write.set()
        may_finish.wait(10)
        return True

    sock_free = threading.Event()
    written: list[bytes] = []

    def blocking_write(data: bytes) -> None:  # the socket is full until sock_free
        sock_free.wait(10)
        written.append(bytes(data))

    beat = threading.Thread(target=outbox.offer, args=(b"\n", slow_write_now), daemon=True)
    beat.start()
    assert in_write.wait(5)
    outbox._write = blocking_write  # type: ignore[attr-defined]  # from now on the socket is full
    outbox.put(b"ACK")
    outbox.flush()  # finds the lock taken, waits the hand-over, leaves its bytes queued
    assert outbox.pending
    may_finish.set()
    beat.join(5)
    assert not beat.is_alive(), "the heart-beat's thread blocked writing bytes left to it"
    assert written == []
    sock_free.set()
    deadline = time.monotonic() + 5
    while outbox.pending or outbox.writing:
        assert time.monotonic() < deadline, "the bytes left to the heart-beat were stranded"
        time.sleep(0.01)
    assert written == [b"ACK"]
