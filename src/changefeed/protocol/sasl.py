"""SASL payloads carried by SASL_AUTH / SASL_STEP (dcp-wire.md §3).

PLAIN is ``authzid \\0 user \\0 password`` (authzid usually empty). SCRAM messages are opaque
strings here; the SCRAM state machine is the ``scramp`` library's, used by the server and client.
"""

from __future__ import annotations

from dataclasses import dataclass

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.status import Status

MECHANISMS = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")
# scramp's names for our mechanisms.
SCRAMP_NAMES = {"SCRAM-SHA512": "SCRAM-SHA-512", "SCRAM-SHA256": "SCRAM-SHA-256"}


@dataclass(frozen=True, slots=True)
class PlainCredentials:
    authzid: str
    user: str
    password: str


def encode_plain(user: str, password: str, authzid: str = "") -> bytes:
    if "\0" in user or "\0" in password or "\0" in authzid:
        raise ValueError("PLAIN credentials must not contain NUL")
    return f"{authzid}\0{user}\0{password}".encode()


def decode_plain(payload: bytes) -> PlainCredentials:
    """Raises ProtocolError(AUTH_ERROR) unless the payload has exactly three NUL-split parts."""
    parts = payload.split(b"\0")
    if len(parts) != 3:
        raise ProtocolError("PLAIN payload must be authzid\\0user\\0password", Status.AUTH_ERROR)
    try:
        authzid, user, password = (p.decode() for p in parts)
    except UnicodeDecodeError:
        raise ProtocolError("PLAIN payload is not UTF-8", Status.AUTH_ERROR) from None
    if not user:
        raise ProtocolError("PLAIN payload has an empty user", Status.AUTH_ERROR)
    return PlainCredentials(authzid, user, password)


def decode_mechanisms(value: bytes) -> list[str]:
    """SASL_LIST_MECHS response: space-separated mechanism names."""
    return value.decode(errors="replace").split()
