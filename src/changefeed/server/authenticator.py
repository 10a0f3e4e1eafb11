"""Server side of SASL for one connection: PLAIN and SCRAM-SHA256/512 (scramp does SCRAM).

Sans-IO: each ``auth``/``step`` call takes the request payload and returns ``(status, value)``
to answer with; ``user`` is set once authentication succeeded. A failed attempt leaves the
connection unauthenticated and may be retried.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from scramp import ScramException, ScramMechanism
from scramp.core import ScramServer

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.sasl import decode_plain
from changefeed.protocol.status import Status
from changefeed.server.users import ITERATIONS, SCRAM_MECHANISMS, Users

MECHANISMS = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")


class SaslAuthenticator:
    """One connection's SASL exchange; `user` is set once it succeeded."""

    def __init__(self, users: Users) -> None:
        self._users = users
        self._scram: ScramServer | None = None
        self._scram_user: str | None = None
        self.user: str | None = None

    @staticmethod
    def mechanisms() -> bytes:
        return " ".join(MECHANISMS).encode()

    def auth(self, mechanism: str, payload: bytes) -> tuple[int, bytes]:
        """SASL_AUTH: start (and for PLAIN, finish) an exchange."""
        self._scram = None
        if mechanism == "PLAIN":
            try:
                credentials = decode_plain(payload)
            except ProtocolError:
                return Status.AUTH_ERROR, b"malformed PLAIN payload"
            if self._users.check_password(credentials.user, credentials.password):
                self.user = credentials.user
                return Status.SUCCESS, b""
            return Status.AUTH_ERROR, b"authentication failed"
        scramp_name = SCRAM_MECHANISMS.get(mechanism)
        if scramp_name is None:
            return Status.AUTH_ERROR, f"unsupported mechanism {mechanism!r}".encode()
        server = ScramMechanism(scramp_name).make_server(
            lambda user: self._auth_info(user, mechanism)
        )
        try:
            server.set_client_first(payload.decode())
        except (ScramException, UnicodeDecodeError):
            return Status.AUTH_ERROR, b"authentication failed"
        self._scram = server
        return Status.AUTH_CONTINUE, server.get_server_first().encode()

    def step(self, mechanism: str, payload: bytes) -> tuple[int, bytes]:
        """SASL_STEP: the client's final SCRAM message."""
        server, self._scram = self._scram, None
        if server is None or mechanism not in SCRAM_MECHANISMS:
            return Status.EINVAL, b"no SASL exchange in progress"
        try:
            server.set_client_final(payload.decode())
        except (ScramException, UnicodeDecodeError):
            return Status.AUTH_ERROR, b"authentication failed"
        if self._scram_user is None:  # a decoy exchange never succeeds
            return Status.AUTH_ERROR, b"authentication failed"
        self.user = self._scram_user
        return Status.SUCCESS, server.get_server_final().encode()

    def _auth_info(self, user: str, mechanism: str) -> tuple[bytes, bytes, bytes, int]:
        keys = self._users.scram_keys(user, mechanism)
        if keys is None:
            # An unknown user gets a stable fake salt and keys no proof can match, so the
            # exchange fails at the last step, as for a wrong password (RFC 5802 §5.1): the
            # first step does not tell a caller which user names exist.
            self._scram_user = None
            return _decoy_auth_info(user, mechanism)
        self._scram_user = user
        return keys.auth_info()


_DECOY_SECRET = secrets.token_bytes(32)  # per process: decoys are stable within a node's life


def _decoy_auth_info(user: str, mechanism: str) -> tuple[bytes, bytes, bytes, int]:
    digest = hmac.new(_DECOY_SECRET, f"{mechanism}:{user}".encode(), hashlib.sha512).digest()
    return digest[:16], digest[16:48], digest[48:64] + digest[:16], ITERATIONS
