"""The broker's users file: one user a line, passwords stored as salted PBKDF2 hashes.

Format (UTF-8 text; blank lines and lines starting with '#' are ignored)::

    name:pbkdf2-sha256$<iterations>$<salt, base64>$<hash, base64>

Both protocols check logins here (STOMP login/passcode, AMQP SASL PLAIN), so a
pair has one source of users. A successful check is remembered for the life
of the process (keyed by a hash of the password, never the password), so a
client that reconnects many times pays the key-derivation cost once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

from reference_broker._files import replace_atomically

__all__ = ["UsersFile", "UsersFileError", "hash_password"]

_SCHEME = "pbkdf2-sha256"
_ITERATIONS = 200_000


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


class UsersFile:
    """Users and their password hashes, loaded from (and saved to) a file."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self._users: dict[str, str] = dict(users or {})
        self._verified: set[tuple[str, bytes]] = set()

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
        self._verified = {v for v in self._verified if v[0] != name}

    def __contains__(self, name: object) -> bool:
        return name in self._users

    def __len__(self) -> int:
        return len(self._users)

    def verify(self, name: str | None, password: str | None) -> bool:
        """Whether the name and password match a user."""
        if name is None or password is None:
            return False
        stored = self._users.get(name)
        if stored is None:
            return False
        key = (name, hashlib.sha256(stored.encode() + b"\0" + password.encode()).digest())
        if key in self._verified:
            return True
        if _check(stored, password):
            self._verified.add(key)
            return True
        return False
