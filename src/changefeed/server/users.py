"""The users file: user names with salted SCRAM keys, never passwords (``changefeed user add``).

One JSON file (``users.json`` in the data directory). For each user and each SCRAM mechanism it
holds salt, iteration count, stored key and server key (RFC 5802). PLAIN logins are checked by
deriving the stored key from the offered password with the same salt, so no password is kept.
"""

from __future__ import annotations

import hmac
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scramp import ScramMechanism

SCRAM_MECHANISMS = {"SCRAM-SHA512": "SCRAM-SHA-512", "SCRAM-SHA256": "SCRAM-SHA-256"}
ITERATIONS = 4096  # RFC 7677's minimum for SHA-256; login cost ~ a few ms


@dataclass(frozen=True, slots=True)
class ScramKeys:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def auth_info(self) -> tuple[bytes, bytes, bytes, int]:
        return self.salt, self.stored_key, self.server_key, self.iterations


class UsersError(ValueError):
    """The users file is missing or malformed; the message names the file."""


class Users:
    """User name → SCRAM keys per mechanism."""

    def __init__(self, entries: dict[str, dict[str, ScramKeys]] | None = None) -> None:
        self._entries = entries or {}

    def __contains__(self, user: str) -> bool:
        return user in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def add(self, user: str, password: str) -> None:
        if not user or ":" in user:
            raise UsersError(f"invalid user name {user!r}")
        keys = {}
        for ours, scramp_name in SCRAM_MECHANISMS.items():
            salt, stored, server, iterations = ScramMechanism(scramp_name).make_auth_info(
                password, iteration_count=ITERATIONS
            )
            keys[ours] = ScramKeys(salt, stored, server, iterations)
        self._entries[user] = keys

    def remove(self, user: str) -> None:
        self._entries.pop(user, None)

    def scram_keys(self, user: str, mechanism: str) -> ScramKeys | None:
        return self._entries.get(user, {}).get(mechanism)

    def check_password(self, user: str, password: str) -> bool:
        """PLAIN: derive the SHA-512 stored key from ``password`` and compare in constant time."""
        keys = self.scram_keys(user, "SCRAM-SHA512")
        if keys is None:
            return False
        _, stored, _, _ = ScramMechanism("SCRAM-SHA-512").make_auth_info(
            password, iteration_count=keys.iterations, salt=keys.salt
        )
        return hmac.compare_digest(stored, keys.stored_key)

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a file."""
        raw = {
            user: {
                mech: {
                    "salt": k.salt.hex(),
                    "stored_key": k.stored_key.hex(),
                    "server_key": k.server_key.hex(),
                    "iterations": k.iterations,
                }
                for mech, k in keys.items()
            }
            for user, keys in self._entries.items()
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".users.")
        with os.fdopen(fd, "w") as handle:
            json.dump(raw, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Users:
        try:
            raw = json.loads(path.read_text())
            entries = {
                user: {
                    mech: ScramKeys(
                        bytes.fromhex(k["salt"]),
                        bytes.fromhex(k["stored_key"]),
                        bytes.fromhex(k["server_key"]),
                        int(k["iterations"]),
                    )
                    for mech, k in keys.items()
                }
                for user, keys in raw.items()
            }
        except FileNotFoundError:
            raise UsersError(f"users file {path} does not exist") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise UsersError(f"users file {path} is malformed: {error}") from None
        return cls(entries)
