"""The users file: user names with roles and salted SCRAM keys, never passwords; the node secret.

One JSON file (``users.json`` in the data directory), written by ``changefeed user add``::

    {"alice": {"roles": ["data_reader", "data_dcp_reader"],
               "SCRAM-SHA512": {"salt": hex, "stored_key": hex, "server_key": hex,
                                "iterations": 4096},
               "SCRAM-SHA256": {...}}}

For each user and each SCRAM mechanism it holds salt, iteration count, stored key and server key
(RFC 5802). PLAIN logins are checked by deriving the stored key from the offered password with
the same salt, so no password is kept. ``roles`` are Couchbase role names (`privileges.py`); an
entry without ``roles`` (written before roles existed) gets ``["admin"]``, every privilege, as it
had then. Everything a login will use is checked at load: a malformed entry stops the node at
start, naming the file, the user and the field, instead of failing that user's logins later.

The node secret (``node.secret`` in the data directory, 32 random bytes, mode 0600) is made on
first start. `decoy_keys` derives from it, for a user name that is not in the file, keys shaped
like a real user's, so SASL replies do not tell which names exist, also across restarts.

What it does not do: authenticate anyone (`authenticator.py` does), or reload the file while
the node runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scramp import ScramException, ScramMechanism

from changefeed.server.privileges import DEFAULT_ROLES, Privilege, privileges_of

log = logging.getLogger("changefeed.server")

SCRAM_MECHANISMS = {"SCRAM-SHA512": "SCRAM-SHA-512", "SCRAM-SHA256": "SCRAM-SHA-256"}
# PLAIN passwords are checked against the keys of this mechanism.
PLAIN_MECHANISM = "SCRAM-SHA512"
# Stored and server keys are HMAC outputs of the mechanism's hash (RFC 5802 §3).
KEY_SIZES = {"SCRAM-SHA512": 64, "SCRAM-SHA256": 32}

# RFC 7677's minimum for SHA-256, and scramp's: it refuses fewer when a PLAIN password is
# hashed. One PLAIN check costs 1.7-2 ms of SHA-512 (measured), on a hashing thread.
ITERATIONS = 4096
# Bounds one PLAIN check at ~0.5 s of a hashing thread (2 ms per 4096 iterations); OWASP's
# advice for PBKDF2-SHA512 (210,000) fits. A file asking for more is refused at load.
ITERATIONS_MAX = 1_000_000
# Salts we make: 32 bytes, the length scramp gives by default, so files written before this
# constant existed hold the same length and decoys (of this length) look like them.
SALT_SIZE = 32
# scramp refuses a shorter salt at login (scramp.core.Salt.MIN_LENGTH); refused at load instead.
SALT_SIZE_MIN = 12

NODE_SECRET_FILE = "node.secret"
NODE_SECRET_SIZE = 32  # the HMAC-SHA-512 key that derives decoys; 256 bits cannot be guessed

assert set(KEY_SIZES) == set(SCRAM_MECHANISMS)
assert PLAIN_MECHANISM in SCRAM_MECHANISMS
assert SALT_SIZE_MIN <= SALT_SIZE <= hashlib.sha512().digest_size
assert ITERATIONS <= ITERATIONS_MAX


class UsersError(ValueError):
    """The users file or the node secret is missing or malformed, or a user cannot be added;
    the message names the file or the user."""


@dataclass(frozen=True, slots=True)
class ScramKeys:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def auth_info(self) -> tuple[bytes, bytes, bytes, int]:
        return self.salt, self.stored_key, self.server_key, self.iterations

    def check(self, mechanism: str) -> None:
        """Raises ValueError naming the field unless a login with ``mechanism`` can use these."""
        if len(self.salt) < SALT_SIZE_MIN:
            raise ValueError(
                f"{mechanism} salt is {len(self.salt)} bytes; at least {SALT_SIZE_MIN} needed"
            )
        for field, value in (("stored_key", self.stored_key), ("server_key", self.server_key)):
            if len(value) != KEY_SIZES[mechanism]:
                raise ValueError(
                    f"{mechanism} {field} is {len(value)} bytes, not {KEY_SIZES[mechanism]}"
                )
        if not ITERATIONS <= self.iterations <= ITERATIONS_MAX:
            raise ValueError(
                f"{mechanism} iterations {self.iterations} is outside "
                f"[{ITERATIONS}, {ITERATIONS_MAX}]"
            )


@dataclass(frozen=True, slots=True)
class UserRecord:
    """One user: SCRAM keys per mechanism (every one of SCRAM_MECHANISMS) and roles."""

    keys: dict[str, ScramKeys]
    roles: tuple[str, ...]
    privileges: frozenset[Privilege]


class Users:
    """User name → roles and SCRAM keys per mechanism."""

    def __init__(self, records: dict[str, UserRecord] | None = None) -> None:
        self._records = records or {}

    def __contains__(self, user: str) -> bool:
        return user in self._records

    def names(self) -> list[str]:
        return sorted(self._records)

    def add(self, user: str, password: str, roles: Iterable[str] | None = None) -> None:
        """Add ``user``, or replace its password (and its roles, when given).

        Args:
            user: a non-empty name without ``:``.
            password: non-empty; SASLprep (RFC 4013) must accept it, as every login applies it.
            roles: Couchbase role names (`privileges.ROLE_PRIVILEGES`), at least one. None keeps
                an existing user's roles and gives a new user ``admin`` (what every user had
                before roles existed).

        Raises:
            UsersError: the name, the password or a role is refused; the message says which.
        """
        _check_name(user)
        if not password:
            raise UsersError(f"empty password for user {user!r}: a user needs a password")
        if roles is None:
            existing = self._records.get(user)
            roles = existing.roles if existing is not None else DEFAULT_ROLES
        role_names = _check_roles(user, roles)
        keys = {}
        for ours, scramp_name in SCRAM_MECHANISMS.items():
            try:
                salt, stored, server, iterations = ScramMechanism(scramp_name).make_auth_info(
                    password, iteration_count=ITERATIONS, salt=secrets.token_bytes(SALT_SIZE)
                )
            except ScramException as error:  # SASLprep refused the password
                raise UsersError(f"password for user {user!r} is refused: {error}") from None
            keys[ours] = ScramKeys(salt, stored, server, iterations)
            keys[ours].check(ours)
        self._records[user] = UserRecord(keys, role_names, privileges_of(role_names))

    def remove(self, user: str) -> None:
        self._records.pop(user, None)

    def scram_keys(self, user: str, mechanism: str) -> ScramKeys | None:
        record = self._records.get(user)
        return None if record is None else record.keys.get(mechanism)

    def roles(self, user: str) -> tuple[str, ...]:
        """``user``'s role names; empty for a user that does not exist."""
        record = self._records.get(user)
        return () if record is None else record.roles

    def privileges(self, user: str) -> frozenset[Privilege]:
        """What ``user``'s roles grant; nothing for a user that does not exist."""
        record = self._records.get(user)
        return frozenset() if record is None else record.privileges

    def check_password(self, user: str, password: str) -> bool:
        """PLAIN: whether ``password`` is ``user``'s. False for an unknown user (at once: the
        authenticator hashes a decoy instead, so that its timing does not tell) and for a
        password SASLprep refuses; never raises."""
        keys = self.scram_keys(user, PLAIN_MECHANISM)
        return keys is not None and password_matches(keys, password)

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename, mode 0600) so a crash never leaves half a file."""
        raw = {
            user: {
                "roles": list(record.roles),
                **{
                    mechanism: {
                        "salt": keys.salt.hex(),
                        "stored_key": keys.stored_key.hex(),
                        "server_key": keys.server_key.hex(),
                        "iterations": keys.iterations,
                    }
                    for mechanism, keys in record.keys.items()
                },
            }
            for user, record in self._records.items()
        }
        _write_private_file(path, json.dumps(raw, indent=1).encode())

    @classmethod
    def load(cls, path: Path) -> Users:
        """Read and check every entry (see the module docstring for the format).

        Raises:
            UsersError: the file is missing, or not JSON, or an entry is malformed; the message
                names the file, the user and the field.
        """
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsersError(f"users file {path} does not exist") from None
        except (ValueError, OSError) as error:
            raise UsersError(f"users file {path} is malformed: {error}") from None
        if not isinstance(raw, dict):
            raise UsersError(f"users file {path} is malformed: not a JSON object")
        records = {}
        for user, entry in raw.items():
            try:
                records[user] = _parse_record(user, entry)
            except (ValueError, KeyError, TypeError) as error:
                message = f"users file {path} is malformed: user {user!r}: {error}"
                raise UsersError(message) from None
        return cls(records)


def password_matches(keys: ScramKeys, password: str, mechanism: str = PLAIN_MECHANISM) -> bool:
    """Derive the stored key from ``password`` with ``keys``' salt and iterations and compare in
    constant time. The cost is the PBKDF2 (``keys.iterations`` rounds): run it off the event
    loop. False, without hashing, for a password SASLprep (RFC 4013) refuses."""
    try:
        _, stored, _, _ = ScramMechanism(SCRAM_MECHANISMS[mechanism]).make_auth_info(
            password, iteration_count=keys.iterations, salt=keys.salt
        )
    except ScramException:  # SASLprep refused the password: no user has it
        return False
    return hmac.compare_digest(stored, keys.stored_key)


def decoy_keys(secret: bytes, user: str, mechanism: str) -> ScramKeys:
    """Keys for a user name that does not exist, shaped like a real user's: a salt of SALT_SIZE
    bytes, keys of the mechanism's size, ITERATIONS. They depend only on ``secret``, ``user`` and
    ``mechanism``, so a name gets the same salt on every attempt and after a restart, as a real
    user does. No password matches them (that would need a SHA-512 preimage)."""
    assert len(secret) == NODE_SECRET_SIZE, len(secret)
    assert mechanism in KEY_SIZES, mechanism
    name = user.encode("utf-8", "surrogatepass")

    def derive(purpose: bytes) -> bytes:
        message = b"\0".join((purpose, mechanism.encode(), name))
        return hmac.new(secret, message, hashlib.sha512).digest()

    size = KEY_SIZES[mechanism]
    keys = ScramKeys(
        derive(b"salt")[:SALT_SIZE],
        derive(b"stored_key")[:size],
        derive(b"server_key")[:size],
        ITERATIONS,
    )
    keys.check(mechanism)
    return keys


def load_or_create_node_secret(data_dir: Path) -> bytes:
    """The node secret in ``data_dir``; on first start make it (random, mode 0600).

    Raises:
        UsersError: the file exists with the wrong length; deleting it makes a new secret
            (unknown names then get new decoy salts, once).
    """
    path = data_dir / NODE_SECRET_FILE
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        secret = secrets.token_bytes(NODE_SECRET_SIZE)
        _write_private_file(path, secret)
        log.debug("created node secret %s", path)
        return secret
    if len(secret) != NODE_SECRET_SIZE:
        raise UsersError(
            f"node secret {path} is {len(secret)} bytes, not {NODE_SECRET_SIZE}; "
            "delete it to make a new one"
        )
    if path.stat().st_mode & 0o077:
        log.warning("node secret %s is readable by others: chmod 600 it", path)
    return secret


def _write_private_file(path: Path, data: bytes) -> None:
    """Atomically: a temp file (mode 0600 from mkstemp), fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_name(user: str) -> None:
    if not user or ":" in user:
        raise UsersError(f"invalid user name {user!r}")


def _check_roles(user: str, roles: Iterable[str]) -> tuple[str, ...]:
    if isinstance(roles, str):  # one role name, not its characters
        roles = [roles]
    names = tuple(dict.fromkeys(roles))
    if not names:
        raise UsersError(f"user {user!r} needs at least one role")
    if not all(isinstance(name, str) for name in names):
        raise UsersError(f"roles of user {user!r} must be names: {names!r}")
    try:
        privileges_of(names)
    except ValueError as error:
        raise UsersError(f"user {user!r}: {error}") from None
    return names


def _parse_record(user: str, entry: Any) -> UserRecord:
    _check_name(user)
    if not isinstance(entry, dict):
        raise TypeError(f"entry is {type(entry).__name__}, not an object")
    unknown = set(entry) - set(SCRAM_MECHANISMS) - {"roles"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    roles = entry.get("roles", list(DEFAULT_ROLES))
    if not isinstance(roles, list):
        raise TypeError(f"roles is {type(roles).__name__}, not a list")
    role_names = _check_roles(user, roles)
    keys = {}
    for mechanism in SCRAM_MECHANISMS:
        if mechanism not in entry:
            raise ValueError(f"no {mechanism} keys")
        keys[mechanism] = _parse_keys(mechanism, entry[mechanism])
    return UserRecord(keys, role_names, privileges_of(role_names))


def _parse_keys(mechanism: str, raw: Any) -> ScramKeys:
    if not isinstance(raw, dict):
        raise TypeError(f"{mechanism} is {type(raw).__name__}, not an object")
    missing = {"salt", "stored_key", "server_key", "iterations"} - set(raw)
    if missing:
        raise ValueError(f"{mechanism} has no {', '.join(sorted(missing))}")
    iterations = raw["iterations"]
    if not isinstance(iterations, int) or isinstance(iterations, bool):
        raise TypeError(f"{mechanism} iterations is {iterations!r}, not an integer")
    keys = ScramKeys(
        _hex_field(mechanism, raw, "salt"),
        _hex_field(mechanism, raw, "stored_key"),
        _hex_field(mechanism, raw, "server_key"),
        iterations,
    )
    keys.check(mechanism)
    return keys


def _hex_field(mechanism: str, raw: dict[str, Any], field: str) -> bytes:
    value = raw[field]
    if not isinstance(value, str):
        raise TypeError(f"{mechanism} {field} is {type(value).__name__}, not a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{mechanism} {field} is not hex") from None
