"""LoginGuard: password checks off the event loop, equal cost for unknown users, throttling.

Real key derivations on a real thread; the only thing wrapped is the derivation itself, to
count the calls and see which thread makes them.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from reference_broker import users as users_module
from reference_broker.users import LoginGuard, LoginPolicy, UsersFile

pytestmark = pytest.mark.timeout(60)

POLICY = LoginPolicy(base_delay=0.05, max_delay=0.4, forget_after=5.0)
# For tests where a waiter must wake inside the penalty however slow the machine is.
LONG = LoginPolicy(base_delay=1.0, max_delay=2.0, forget_after=5.0)


@pytest.fixture(scope="module")
def users() -> UsersFile:
    users = UsersFile()
    users.add("alice", "right")
    users.add("bob", "also-right")
    return users


@pytest.fixture
def derivations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every key derivation: the record's salt and the thread that ran it."""
    calls: list[tuple[str, int]] = []
    real = users_module._check

    def check(stored: str, password: str) -> bool:
        calls.append((stored.split("$")[2], threading.get_ident()))
        return real(stored, password)

    monkeypatch.setattr(users_module, "_check", check)
    return calls


def test_the_derivation_runs_off_the_event_loop(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> tuple[bool, int]:
        guard = LoginGuard(users, POLICY)
        try:
            return await guard.check("alice", "right", "10.0.0.1:5"), threading.get_ident()
        finally:
            guard.close()

    ok, loop_thread = asyncio.run(main())
    assert ok
    assert len(derivations) == 1
    assert derivations[0][1] != loop_thread


def test_an_unknown_user_costs_one_derivation_like_a_known_one(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> list[bool]:
        guard = LoginGuard(users, POLICY)
        try:
            # Different sources and names: no throttle in the way.
            return [
                await guard.check("alice", "wrong", "10.0.0.1:1"),
                await guard.check("mallory", "wrong", "10.0.0.2:1"),
            ]
        finally:
            guard.close()

    assert asyncio.run(main()) == [False, False]
    assert len(derivations) == 2
    known, unknown = (salt for salt, _ in derivations)
    assert known != unknown  # the unknown user's was derived against the dummy record
    assert unknown == users_module._dummy().split("$")[2]
    iterations = {s.split("$")[1] for s in (users_module._dummy(), users._users["alice"])}
    assert len(iterations) == 1


def test_failed_logins_are_answered_after_growing_delays(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> list[float]:
        guard = LoginGuard(users, POLICY)
        took = []
        try:
            for i in range(4):
                started = time.monotonic()
                # Another source each time: the per-user throttle alone.
                assert not await guard.check("alice", "wrong", f"10.0.1.{i}:1")
                took.append(time.monotonic() - started)
        finally:
            guard.close()
        return took

    took = asyncio.run(main())
    for n, elapsed in enumerate(took, 1):
        assert elapsed >= POLICY.delay(n), (n, took)
    assert [POLICY.delay(n) for n in range(1, 6)] == [0.05, 0.1, 0.2, 0.4, 0.4]
    assert len(derivations) == 4


def test_attempts_in_a_penalty_are_refused_without_a_derivation(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> tuple[list[bool], LoginGuard]:
        guard = LoginGuard(users, LONG)
        try:
            # One wrong password, then (while it is checked) the right one from the same
            # source for another user, and the right one for the same user elsewhere.
            results = await asyncio.gather(
                guard.check("alice", "wrong", "10.0.2.1:1"),
                guard.check("bob", "also-right", "10.0.2.1:2"),
                guard.check("alice", "right", "10.0.2.9:1"),
            )
        finally:
            guard.close()
        return list(results), guard

    users._verified.clear()
    results, guard = asyncio.run(main())
    assert results == [False, False, False]
    assert len(derivations) == 1
    assert guard.throttled == 2


def test_a_login_verified_before_gets_in_during_a_penalty(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> list[bool]:
        guard = LoginGuard(users, POLICY)
        try:
            first = await guard.check("bob", "also-right", "10.0.3.1:1")
            assert not await guard.check("bob", "wrong", "10.0.3.2:1")
            again = await guard.check("bob", "also-right", "10.0.3.3:1")
            assert guard.throttled == 0  # let in, not made to wait out the penalty
            return [first, again]
        finally:
            guard.close()

    users._verified.clear()
    assert asyncio.run(main()) == [True, True]
    assert len(derivations) == 2


def test_a_pool_of_logins_at_once_all_get_in_with_one_derivation(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> list[bool]:
        guard = LoginGuard(users, POLICY)
        try:
            return list(
                await asyncio.gather(
                    *(guard.check("alice", "right", f"10.0.4.1:{i}") for i in range(8))
                )
            )
        finally:
            guard.close()

    users._verified.clear()
    assert asyncio.run(main()) == [True] * 8
    assert len(derivations) == 1


def test_checks_past_max_pending_are_refused(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> list[bool]:
        guard = LoginGuard(users, LoginPolicy(base_delay=0.05, max_delay=0.4, max_pending=1))
        try:
            return list(
                await asyncio.gather(
                    guard.check("alice", "wrong", "10.0.5.1:1"),
                    guard.check("bob", "wrong", "10.0.5.2:1"),
                )
            )
        finally:
            guard.close()

    assert asyncio.run(main()) == [False, False]
    assert len(derivations) == 1


def test_anonymous_only_where_allowed(users: UsersFile) -> None:
    async def main() -> tuple[bool, bool]:
        guard = LoginGuard(users, POLICY)
        try:
            return (
                await guard.authenticate(None, None, "10.0.6.1:1", allow_anonymous=True),
                await guard.authenticate(None, None, "10.0.6.1:1", allow_anonymous=False),
            )
        finally:
            guard.close()

    assert asyncio.run(main()) == (True, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_delay": 0}, "base_delay"),
        ({"base_delay": 2, "max_delay": 1}, "max_delay"),
        ({"forget_after": 1, "max_delay": 5}, "forget_after"),
        ({"max_pending": 0}, "max_pending"),
        ({"max_wait": 0}, "max_wait"),
    ],
)
def test_a_bad_policy_is_refused_by_name(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoginPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_client_that_hangs_up_during_its_check_still_pays_for_it(
    users: UsersFile, derivations: list[tuple[str, int]]
) -> None:
    async def main() -> LoginGuard:
        guard = LoginGuard(users, LONG)
        try:
            first = asyncio.ensure_future(guard.check("alice", "wrong", "10.0.7.1:1"))
            while not derivations:  # the derivation is under way
                await asyncio.sleep(0.001)
            first.cancel()  # the connection was lost: its task is cancelled
            # The next guess, from elsewhere, finds the user in penalty.
            assert not await guard.check("alice", "wrong-too", "10.0.7.2:1")
        finally:
            guard.close()
        return guard

    users._verified.clear()
    guard = asyncio.run(main())
    assert len(derivations) == 1
    assert guard.throttled == 1


def test_checks_that_waited_past_max_wait_are_refused_without_a_derivation(
    users: UsersFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard's clock jumps 100 s once the first derivation starts: every check queued
    # behind it has then waited past max_wait, however fast the machine is.
    offset = [0.0]
    derived: list[str] = []
    real = users_module._check

    def check(stored: str, password: str) -> bool:
        derived.append(stored)
        offset[0] = 100.0
        return real(stored, password)

    monkeypatch.setattr(users_module, "_check", check)

    async def main() -> tuple[list[bool], LoginGuard]:
        guard = LoginGuard(
            users,
            LoginPolicy(base_delay=0.05, max_delay=0.4, max_wait=1.0),
            clock=lambda: time.monotonic() + offset[0],
        )
        try:
            # Different users and sources: nothing throttles; the second and third wait for
            # the worker while the first one's derivation runs.
            results = await asyncio.gather(
                guard.check("alice", "right", "10.0.8.1:1"),
                guard.check("bob", "also-right", "10.0.8.2:1"),
                guard.check("carol", "x", "10.0.8.3:1"),
                # Waits for bob's check on its keys, which the overload skips: refused too,
                # rather than queued again.
                guard.check("bob", "also-right", "10.0.8.2:2"),
            )
        finally:
            guard.close()
        return list(results), guard

    users._verified.clear()
    results, guard = asyncio.run(main())
    assert results == [True, False, False, False]
    assert len(derived) == 1
    assert guard.overloaded == 3
