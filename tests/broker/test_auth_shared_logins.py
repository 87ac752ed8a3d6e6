"""Verified logins as keyed digests (reference_broker.users.VerifiedLogins): what a backup
takes from its live, and what it must not.

Real key derivations at few iterations; the derivation is counted by wrapping it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from reference_broker import users as users_module
from reference_broker.replication import ReplicationProtocolError, decode_logins, encode_logins
from reference_broker.users import (
    MAX_VERIFIED_LOGINS,
    SharedLogin,
    UsersFile,
    VerifiedLogins,
    hash_password,
)

SECRET = bytes(range(32))


@pytest.fixture
def derivations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    check = users_module._check

    def counted(stored: str, password: str) -> bool:
        calls.append(stored)
        return check(stored, password)

    monkeypatch.setattr(users_module, "_check", counted)
    return calls


def pair_files(record: str, backup_record: str | None = None) -> tuple[UsersFile, UsersFile]:
    live = UsersFile({"app": record})
    backup = UsersFile({"app": record if backup_record is None else backup_record})
    for users in (live, backup):
        users.verified_logins.use_pair_secret(SECRET)
    return live, backup


def test_a_login_the_live_verified_costs_the_backup_no_derivation(
    derivations: list[str],
) -> None:
    live, backup = pair_files(hash_password("s3cret", iterations=1000))
    assert live.verify("app", "s3cret")
    assert backup.absorb_logins(live.verified_logins.snapshot()) == 1
    assert backup.verified_before("app", "s3cret")
    assert backup.verify("app", "s3cret")
    assert len(derivations) == 1  # the live's own
    assert not backup.verified_before("app", "wrong")


def test_the_digest_holds_neither_the_password_nor_its_plain_hash() -> None:
    live, _ = pair_files(hash_password("s3cret", iterations=1000))
    assert live.verify("app", "s3cret")
    (login,) = live.verified_logins.snapshot()
    plain = hashlib.sha256(b"s3cret").hexdigest()
    assert all("s3cret" not in field and plain not in field for field in login)


def test_failed_logins_are_never_shared() -> None:
    live, _ = pair_files(hash_password("s3cret", iterations=1000))
    sent: list[SharedLogin] = []
    live.verified_logins.subscribe(sent.append)
    assert not live.verify("app", "wrong")
    assert not live.verify("nobody", "s3cret")
    assert sent == [] and live.verified_logins.snapshot() == []
    assert live.verify("app", "s3cret")
    assert [name for name, _, _ in sent] == ["app"]


def test_a_changed_password_invalidates_the_digest(derivations: list[str]) -> None:
    users = UsersFile()
    users.verified_logins.use_pair_secret(SECRET)
    users._users["app"] = hash_password("old", iterations=1000)
    assert users.verify("app", "old")
    assert users.verified_before("app", "old")
    users.add("app", "new")
    assert not users.verified_before("app", "old")
    assert len(users.verified_logins) == 0


def test_a_backup_whose_users_file_changed_the_user_drops_the_digest(
    derivations: list[str],
) -> None:
    # The same password under a fresh salt is a new record: the live's digest is for the old.
    live, backup = pair_files(
        hash_password("s3cret", iterations=1000), hash_password("s3cret", iterations=1000)
    )
    assert live.verify("app", "s3cret")
    assert backup.absorb_logins(live.verified_logins.snapshot()) == 0
    assert not backup.verified_before("app", "s3cret")
    assert backup.verify("app", "s3cret")
    assert len(derivations) == 2


def test_a_backup_drops_the_digest_of_a_removed_user() -> None:
    live, _ = pair_files(hash_password("s3cret", iterations=1000))
    assert live.verify("app", "s3cret")
    backup = UsersFile({"other": hash_password("x", iterations=1000)})
    backup.verified_logins.use_pair_secret(SECRET)
    assert backup.absorb_logins(live.verified_logins.snapshot()) == 0
    assert len(backup.verified_logins) == 0


def test_a_digest_made_with_another_secret_does_not_verify(derivations: list[str]) -> None:
    record = hash_password("s3cret", iterations=1000)
    live, _ = pair_files(record)
    other = UsersFile({"app": record})
    other.verified_logins.use_pair_secret(bytes(reversed(SECRET)))
    assert live.verify("app", "s3cret")
    other.absorb_logins(live.verified_logins.snapshot())
    assert not other.verified_before("app", "s3cret")
    # Even a digest put in by hand, past the version check, does not match.
    other.verified_logins._put(live.verified_logins.snapshot()[0])
    assert not other.verified_before("app", "s3cret")


def test_a_new_pair_secret_drops_the_digests_made_with_the_old() -> None:
    live, _ = pair_files(hash_password("s3cret", iterations=1000))
    assert live.verify("app", "s3cret")
    live.verified_logins.use_pair_secret(bytes(reversed(SECRET)))
    assert not live.verified_before("app", "s3cret")


def fill(logins: VerifiedLogins, count: int, stored: Callable[[int], str]) -> None:
    for i in range(count):
        logins.add(f"user-{i}", stored(i), "pw")


def test_the_list_is_bounded_oldest_out() -> None:
    assert MAX_VERIFIED_LOGINS == 10_000
    logins = VerifiedLogins()
    logins.use_pair_secret(SECRET)
    fill(logins, MAX_VERIFIED_LOGINS + 1, lambda i: f"record-{i}")
    assert len(logins) == MAX_VERIFIED_LOGINS
    assert not logins.knows("user-0", "record-0", "pw")
    assert logins.knows("user-1", "record-1", "pw")
    assert logins.knows(f"user-{MAX_VERIFIED_LOGINS}", f"record-{MAX_VERIFIED_LOGINS}", "pw")


def test_a_login_in_use_stays_while_older_ones_go() -> None:
    logins = VerifiedLogins(limit=3)
    fill(logins, 3, lambda i: f"record-{i}")
    assert logins.knows("user-0", "record-0", "pw")  # used: now the most recent
    logins.add("user-3", "record-3", "pw")
    assert logins.knows("user-0", "record-0", "pw")
    assert not logins.knows("user-1", "record-1", "pw")


def test_the_absorbed_list_is_bounded_too() -> None:
    logins = VerifiedLogins(limit=2)
    logins.use_pair_secret(SECRET)
    source = VerifiedLogins()
    source.use_pair_secret(SECRET)
    fill(source, 3, lambda i: f"record-{i}")
    records = {f"user-{i}": f"record-{i}" for i in range(3)}
    assert logins.absorb(source.snapshot(), records) == 3
    assert [name for name, _, _ in logins.snapshot()] == ["user-1", "user-2"]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        VerifiedLogins(limit=0)


def test_logins_cross_the_link_as_sent_and_a_malformed_frame_is_refused() -> None:
    logins: list[SharedLogin] = [("app", "0123456789abcdef", "ab" * 32)]
    assert decode_logins(encode_logins(logins)) == logins
    for payload in (b"{", b'{"app": 1}', b'[["app", "v"]]', b'[["app", "v", 3]]'):
        with pytest.raises(ReplicationProtocolError, match="LOGINS"):
            decode_logins(payload)
