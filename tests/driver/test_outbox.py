"""Decide under the lock, write outside it (issue 17): the outbox and the condition that
flushes it once the lock is let go (docs/core.md, "Decide under the lock, write outside it")."""

from __future__ import annotations

import threading

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
