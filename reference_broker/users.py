"""The broker's users file: one user a line, passwords stored as salted PBKDF2 hashes.

Format (UTF-8 text; blank lines and lines starting with '#' are ignored)::

    name:pbkdf2-sha256$<iterations>$<salt, base64>$<hash, base64>

Both protocols check logins here (STOMP login/passcode, AMQP SASL PLAIN), so a
pair has one source of users. A successful check is remembered (``VerifiedLogins``: a keyed
digest of the name, the password and the user's record version, never the password or a bare
hash of it), so a client that reconnects many times pays the key-derivation cost once. The
live shares the digests with its backup over the replication link, under a key derived from
the pair secret, so after a failover a known login costs the new live one HMAC.

``LoginGuard`` is how a serving node checks a login (docs/security.md):

- The key derivation (75 ms of CPU at 200,000 iterations) runs on the guard's own worker
  thread, never on the event loop; ``hashlib`` releases the GIL while it derives.
- An unknown user costs what a known one does: the password is derived against a dummy
  record with the same iterations, so the time of a refusal says nothing about the name.
- Failed logins are throttled per user name and per source address: after the n-th failure
  on a key, the key is *in penalty* for ``min(base_delay * 2**(n-1), max_delay)`` seconds.
  An attempt on a key in penalty is answered (refused, without a derivation) when the penalty
  ends; the loop awaits, it never sleeps. A key forgets its failures after ``forget_after``
  seconds without one. Attempts on a key with a derivation in flight wait for it, so a pool
  of connections opened at once with the right password all get in.
- A login the process already verified (same user, same password), or the live it followed
  as a backup did, is accepted at once, even for a key in penalty: a flood of wrong passwords
  does not lock out clients that were in.
- At most ``max_pending`` derivations wait for the worker; an attempt past that is refused,
  and so is one that waited ``max_wait`` seconds for the worker (on a starved machine the
  queue is slower than its length says): every attempt is answered within about max_wait.

What it never does: block the loop, keep a password, or tell a wrong password from an unknown
user in what it answers or how long it takes.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from reference_broker._files import replace_atomically

__all__ = [
    "LoginGuard",
    "LoginPolicy",
    "SharedLogin",
    "UsersFile",
    "UsersFileError",
    "VerifiedLogins",
    "hash_password",
    "login_guard",
]

log = logging.getLogger(__name__)

_SCHEME = "pbkdf2-sha256"
_ITERATIONS = 200_000
MAX_VERIFIED_LOGINS = 10_000
_LOGIN_KEY_LABEL = b"hafailover verified-login digests v1"


class UsersFileError(ValueError):
    """The users file is malformed; the message names the file and line."""


def hash_password(
    password: str, *, iterations: int = _ITERATIONS, salt: bytes | None = None
) -> str:
    """The stored form of a password."""
    salt = os.urandom(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return "$".join(
        (
            _SCHEME,
            str(iterations),
            base64.b64encode(salt).decode(),
            base64.b64encode(digest).decode(),
        )
    )


def _check(stored: str, password: str) -> bool:
    scheme, iterations, salt, digest = stored.split("$")
    if scheme != _SCHEME:
        return False
    expected = base64.b64decode(digest)
    actual = hashlib.pbkdf2_hmac(
        "sha256", password.encode(), base64.b64decode(salt), int(iterations)
    )
    return hmac.compare_digest(expected, actual)


# One shared login: (user name, record version, keyed digest), all text, as sent on the link.
SharedLogin = tuple[str, str, str]


class VerifiedLogins:
    """Logins verified by a full derivation, as keyed digests, for a node and its pair.

    A digest is ``HMAC(key, name | version | password)``, where ``version`` names the user's
    record (it changes with the password's salt) and ``key`` is derived from the pair secret
    (``use_pair_secret``; until then a random key of this process). Without the key a digest
    tells nothing about the password; with it, it allows offline guessing (docs/security.md).
    Bounded: past ``limit`` entries the least recently used goes. In memory only; thread-safe
    (the login worker adds, the event loop looks up). Every new entry goes to the listeners
    (the live's replication link), in the thread that verified it.
    """

    def __init__(self, limit: int = MAX_VERIFIED_LOGINS) -> None:
        if limit < 1:
            raise ValueError(f"verified logins: limit must be at least 1, not {limit}")
        self.limit = limit
        self._key = os.urandom(32)
        # (name, digest) -> version, least recently used first
        self._entries: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[SharedLogin], None]] = []

    def use_pair_secret(self, secret: bytes) -> None:
        """Key the digests with the pair secret, so that the other node can check them; drops
        every digest made with the previous key."""
        key = hmac.new(secret, _LOGIN_KEY_LABEL, hashlib.sha256).digest()
        with self._lock:
            if key != self._key:
                self._key = key
                self._entries.clear()

    def subscribe(self, listener: Callable[[SharedLogin], None]) -> Callable[[], None]:
        """Call ``listener`` with every login added from now on; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def version(self, stored: str) -> str:
        """The version of a user's record: a keyed digest of it, so the link carries no hash
        of the stored hash."""
        return hmac.new(self._key, b"record\0" + stored.encode(), hashlib.sha256).hexdigest()[:16]

    def _digest(self, name: str, version: str, password: str) -> str:
        message = b"\0".join((name.encode(), version.encode(), password.encode()))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def add(self, name: str, stored: str, password: str) -> None:
        """A login verified against ``stored``, the user's record (by a derivation)."""
        version = self.version(stored)
        entry = (name, version, self._digest(name, version, password))
        self._put(entry)
        for listener in list(self._listeners):
            listener(entry)

    def knows(self, name: str, stored: str, password: str) -> bool:
        """Whether this login was verified against this very record (one HMAC)."""
        version = self.version(stored)
        key = (name, self._digest(name, version, password))
        with self._lock:
            if self._entries.get(key) != version:
                return False
            self._entries.move_to_end(key)
            return True

    def absorb(self, logins: Iterable[SharedLogin], records: dict[str, str]) -> int:
        """Logins the other node verified; those whose record ``records`` holds no more (user
        removed, password changed) are dropped. Returns how many were kept."""
        kept = 0
        for name, version, digest in logins:
            stored = records.get(name)
            if stored is not None and self.version(stored) == version:
                self._put((name, version, digest))
                kept += 1
        return kept

    def snapshot(self) -> list[SharedLogin]:
        """Every login held, oldest first (what the live sends a backup that attaches)."""
        with self._lock:
            return [(name, version, digest) for (name, digest), version in self._entries.items()]

    def forget_user(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == name]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, entry: SharedLogin) -> None:
        name, version, digest = entry
        with self._lock:
            self._entries[(name, digest)] = version
            self._entries.move_to_end((name, digest))
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)


class UsersFile:
    """Users and their password hashes, loaded from (and saved to) a file."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self._users: dict[str, str] = dict(users or {})
        self._verified = VerifiedLogins()

    @classmethod
    def load(cls, path: Path) -> UsersFile:
        users: dict[str, str] = {}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, stored = line.partition(":")
            parts = stored.split("$")
            if not sep or not name or len(parts) != 4 or parts[0] != _SCHEME:
                raise UsersFileError(
                    f"{path}:{number}: expected 'name:{_SCHEME}$iterations$salt$hash'"
                )
            if not parts[1].isdigit():
                raise UsersFileError(f"{path}:{number}: iterations {parts[1]!r} is not a number")
            if name in users:
                raise UsersFileError(f"{path}:{number}: user {name!r} is listed twice")
            users[name] = stored
        return cls(users)

    def save(self, path: Path) -> None:
        lines = [f"{name}:{stored}" for name, stored in sorted(self._users.items())]
        text = "\n".join(lines) + "\n"
        replace_atomically(path, text.encode("utf-8"), durable=True, mode=0o600)

    def add(self, name: str, password: str) -> None:
        if not name or ":" in name or any(c.isspace() for c in name):
            raise UsersFileError(f"user name {name!r} must be non-empty, without ':' or spaces")
        self._users[name] = hash_password(password)
        self._verified.forget_user(name)

    @property
    def verified_logins(self) -> VerifiedLogins:
        """The logins verified so far (the live shares them with its backup)."""
        return self._verified

    def absorb_logins(self, logins: Iterable[SharedLogin]) -> int:
        """Logins the other node of the pair verified; see VerifiedLogins.absorb."""
        return self._verified.absorb(logins, self._users)

    def __contains__(self, name: object) -> bool:
        return name in self._users

    def __len__(self) -> int:
        return len(self._users)

    def verify(self, name: str | None, password: str | None) -> bool:
        """Whether the name and password match a user (derives the key: slow, blocking)."""
        if name is None or password is None:
            return False
        if self.verified_before(name, password):
            return True
        stored = self._users.get(name)
        if stored is None:
            _check(_dummy(), password)  # the same cost as a known user's check
            return False
        if _check(stored, password):
            self._verified.add(name, stored, password)
            return True
        return False

    def verified_before(self, name: str, password: str) -> bool:
        """Whether this node, or the live it followed, already verified this very name and
        password against the current record (one HMAC)."""
        stored = self._users.get(name)
        return stored is not None and self._verified.knows(name, stored, password)


@functools.cache
def _dummy() -> str:
    """A record no password matches, derived like a real one (made once, when first needed)."""
    return hash_password(os.urandom(16).hex())


@attrs.frozen
class LoginPolicy:
    """How failed logins are throttled (see LoginGuard); seconds unless said otherwise."""

    base_delay: float = 0.1
    max_delay: float = 5.0
    forget_after: float = 60.0
    max_pending: int = 64
    max_wait: float = 5.0

    def __attrs_post_init__(self) -> None:
        if not 0 < self.base_delay <= self.max_delay:
            raise ValueError(
                f"login delays: need 0 < base_delay ({self.base_delay}) <= max_delay "
                f"({self.max_delay})"
            )
        if self.forget_after < self.max_delay:
            raise ValueError(
                f"login forget_after ({self.forget_after}) must be at least max_delay "
                f"({self.max_delay})"
            )
        if self.max_pending < 1:
            raise ValueError(f"login max_pending must be at least 1, not {self.max_pending}")
        if not self.max_wait > 0:
            raise ValueError(f"login max_wait must be positive, not {self.max_wait}")

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.base_delay * 2.0 ** min(failures - 1, 60), self.max_delay)


@attrs.define
class _Key:
    failures: int = 0
    last_failure: float = 0.0
    # A derivation in flight on this key; its result: whether it ran (False: skipped, the
    # worker was overloaded).
    busy: asyncio.Future[bool] | None = None


class LoginGuard:
    """Checks logins for a serving node without blocking its event loop (module docstring)."""

    def __init__(
        self,
        users: UsersFile,
        policy: LoginPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.users = users
        self.policy = policy or LoginPolicy()
        self._clock = clock
        self._keys: dict[tuple[str, str], _Key] = {}
        self._pending = 0
        self._executor: ThreadPoolExecutor | None = None
        self.derivations = 0  # how many key derivations ran (tests and status read it)
        self.throttled = 0  # attempts refused in a penalty, without a derivation
        self.overloaded = 0  # attempts refused after max_wait in the queue, without one

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def authenticate(
        self, name: str | None, password: str | None, source: str, *, allow_anonymous: bool
    ) -> bool:
        """A client's login: anonymous (no name, no password) only where allowed; a refusal
        is logged with the name and the source, never the password."""
        if name is None and password is None and allow_anonymous:
            return True
        if await self.check(name, password, source):
            return True
        log.warning("authentication failed for user %r from %s", name, source)
        return False

    async def check(self, name: str | None, password: str | None, source: str) -> bool:
        """Whether the login is good; refusals come after the penalty of their keys."""
        if name is None or password is None:
            return False
        if self.users.verified_before(name, password):
            return True
        keys = [("user", name), ("source", _host(source))]
        while True:
            busy = [k.busy for k in (self._key(key) for key in keys) if k.busy is not None]
            if not busy:
                break
            await asyncio.wait(busy)
            if self.users.verified_before(name, password):
                return True
            if not all(b.result() for b in busy):
                # The worker is overloaded: a new derivation on these keys would wait in the
                # same queue (and keep its key busy) for nothing.
                self.overloaded += 1
                return False
        now = self._clock()
        penalty = max(self._penalty_end(key) for key in keys) - now
        if penalty > 0:
            self.throttled += 1
            await asyncio.sleep(penalty)
            return False
        if self._pending >= self.policy.max_pending:
            log.warning(
                "login of %r from %s refused: %d checks waiting", name, source, self._pending
            )
            return False
        # Marked busy before this task yields, so that no other attempt on these keys starts
        # a derivation meanwhile. The derivation and its bookkeeping run in a task of their
        # own: a client that hangs up at once still pays for its attempt in penalty.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        for key in keys:
            self._key(key).busy = done
        self._pending += 1
        derivation = loop.create_task(self._derive(name, password, keys, done, self._clock()))
        if await asyncio.shield(derivation):
            return True
        await asyncio.sleep(max(self._penalty_end(key) for key in keys) - self._clock())
        return False

    async def _derive(
        self,
        name: str,
        password: str,
        keys: list[tuple[str, str]],
        done: asyncio.Future[bool],
        queued: float,
    ) -> bool:
        def verify() -> bool | None:
            if self._clock() - queued > self.policy.max_wait:
                return None  # too late to be worth the CPU: refused, no failure counted
            return self.users.verify(name, password)

        ok: bool | None = None
        try:
            ok = await asyncio.get_running_loop().run_in_executor(self._worker(), verify)
        finally:
            self._pending -= 1
            for key in keys:
                self._key(key).busy = None
            done.set_result(ok is not None)
        if ok is None:
            self.overloaded += 1
            log.warning("login of %r refused: waited %.1fs for a check", name, self.policy.max_wait)
            return False
        self.derivations += 1
        if not ok:
            now = self._clock()
            for key in keys:
                state = self._key(key)
                if now - state.last_failure > self.policy.forget_after:
                    state.failures = 0
                state.failures += 1
                state.last_failure = now
        return ok

    def _key(self, key: tuple[str, str]) -> _Key:
        state = self._keys.get(key)
        if state is None:
            if len(self._keys) > 100_000:
                self._forget(self._clock())
            state = self._keys[key] = _Key()
        return state

    def _penalty_end(self, key: tuple[str, str]) -> float:
        state = self._key(key)
        if self._clock() - state.last_failure > self.policy.forget_after:
            return 0.0
        return state.last_failure + self.policy.delay(state.failures)

    def _forget(self, now: float) -> None:
        """Drop keys idle past forget_after: the table stays as big as the recent failures."""
        for key, state in list(self._keys.items()):
            if state.busy is None and now - state.last_failure > self.policy.forget_after:
                del self._keys[key]

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="login-check")
        return self._executor


_GUARDS: weakref.WeakKeyDictionary[UsersFile, LoginGuard] = weakref.WeakKeyDictionary()


def login_guard(users: UsersFile, policy: LoginPolicy | None = None) -> LoginGuard:
    """The one guard of a users file in this process (made with ``policy`` on first use), so
    that every listener of a node throttles on the same failures."""
    guard = _GUARDS.get(users)
    if guard is None:
        guard = _GUARDS[users] = LoginGuard(users, policy)
    return guard


def _host(peer: str) -> str:
    """The address part of ``host:port`` (IPv6 addresses hold colons too)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer
