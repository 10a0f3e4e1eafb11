"""SCRAM (RFC 5802, RFC 7677) as the server sees it: the client's two messages parsed, the
server's two formatted, the client's proof checked. Sans-IO; the authenticator drives it.

The grammar is RFC 5802 §7's, checked strictly, with one leniency: **a client nonce may contain
spaces** (not first, not last). Couchbase's C++ SDK core, which every official Couchbase SDK
wraps, writes its nonce as hex bytes separated by spaces (``0x1f 0xffffffa3 ...``); RFC 5802's
``printable`` (%x21-2B / %x2D-7E) excludes the space, so a strict library (scramp) refuses
every login of those SDKs. Couchbase Server accepts them, and so must a server they use
unchanged. Everything else stays strict: the GS2 header (no channel binding: ``p=`` is refused;
an authorization identity must name the user itself), the SASLname escapes (only ``=2C`` and
``=3D``), SASLprep of the name, the reserved ``m`` extension (refused), attribute order and
syntax, strict base64, the channel-binding echo, the combined nonce in the final message, and
the proof's length.

The cryptography is scramp's: `scramp.utils` HMAC, hash and XOR, composed exactly as RFC 5802
§3 does (ClientKey = ClientProof XOR HMAC(StoredKey, AuthMessage); H(ClientKey) must equal
StoredKey; ServerSignature = HMAC(ServerKey, AuthMessage)). Parsing is ours only because the
nonce rule above lives in scramp's parser.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac as stdlib_hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from scramp import ScramException
from scramp.utils import h as scramp_hash
from scramp.utils import hmac as scramp_hmac
from scramp.utils import saslprep
from scramp.utils import xor as scramp_xor

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.status import Status

# Hash functions of the mechanisms a node offers (their names as on the wire).
HASHES: Final[dict[str, Callable[..., Any]]] = {
    "SCRAM-SHA512": hashlib.sha512,
    "SCRAM-SHA256": hashlib.sha256,
}
# Bounds on the client's parts (its messages fit an unauthenticated frame anyway): generous
# beside the SDKs' nonces (24 to 100 characters) and user names.
NONCE_SIZE_MAX: Final = 512
SERVER_NONCE_BYTES: Final = 24  # 32 base64url characters


class ScramError(ProtocolError):
    """A SCRAM message breaks the grammar or the exchange (answered AUTH_ERROR)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, Status.AUTH_ERROR)


@dataclass(frozen=True, slots=True)
class ClientFirst:
    """The client's first message.

    Attributes:
        gs2_header: ``n,,`` or ``y,,`` (with ``a=<user>`` between the commas if given), verbatim.
        user: the user name, unescaped and SASLprepped.
        nonce: the client nonce, verbatim.
        bare: client-first-message-bare, verbatim (part of the AuthMessage).
    """

    gs2_header: str
    user: str
    nonce: str
    bare: str


@dataclass(frozen=True, slots=True)
class ClientFinal:
    """The client's final message.

    Attributes:
        channel_binding: the decoded ``c=`` attribute.
        nonce: the combined nonce it echoes.
        proof: the decoded client proof.
        without_proof: client-final-message-without-proof, verbatim (part of the AuthMessage).
    """

    channel_binding: bytes
    nonce: str
    proof: bytes
    without_proof: str


def is_nonce(nonce: str, *, allow_spaces: bool = True) -> bool:
    """RFC 5802 ``printable`` characters (no comma), plus interior spaces when allowed."""
    if not 0 < len(nonce) <= NONCE_SIZE_MAX:
        return False
    if allow_spaces and nonce[0] != " " and nonce[-1] != " ":
        return all(c == " " or ("!" <= c <= "~" and c != ",") for c in nonce)
    return all("!" <= c <= "~" and c != "," for c in nonce)


def parse_client_first(message: bytes) -> ClientFirst:
    """Parse and check client-first-message.

    Raises:
        ScramError: anything RFC 5802 §7 does not allow (bar the nonce's spaces), channel
            binding, an authorization identity other than the user, the ``m`` extension, or a
            name SASLprep refuses.
    """
    text = _utf8(message)
    parts = text.split(",")
    if len(parts) < 4:
        raise ScramError("client-first-message needs a GS2 header, a user and a nonce")
    flag, authzid = parts[0], parts[1]
    if flag.startswith("p="):
        raise ScramError("channel binding was requested but is not offered")
    if flag not in ("n", "y"):
        raise ScramError(f"GS2 channel-binding flag {flag[:8]!r} is not n, y or p=")
    if authzid and not authzid.startswith("a="):
        raise ScramError("the GS2 authorization identity must be a=<saslname>")
    attributes = parts[2:]
    if attributes[0].startswith("m="):
        raise ScramError("the reserved m= extension is not supported")
    user = _user(_attribute(attributes[0], "n"))
    nonce = _attribute(attributes[1], "r")
    if not is_nonce(nonce):
        raise ScramError("the client nonce is not printable characters")
    _extensions(attributes[2:])
    if authzid and _user(authzid[2:]) != user:
        raise ScramError("an authorization identity other than the user is not supported")
    gs2_header = f"{flag},{authzid},"
    return ClientFirst(gs2_header, user, nonce, text[len(gs2_header) :])


def server_first(client: ClientFirst, salt: bytes, iterations: int, server_nonce: str) -> str:
    """server-first-message: the combined nonce, the salt and the iteration count."""
    assert is_nonce(server_nonce, allow_spaces=False), server_nonce
    salt_b64 = base64.b64encode(salt).decode()
    return f"r={client.nonce}{server_nonce},s={salt_b64},i={iterations}"


def make_server_nonce() -> str:
    """A fresh server nonce: RFC-printable (base64url), never containing a comma."""
    return secrets.token_urlsafe(SERVER_NONCE_BYTES)


def parse_client_final(message: bytes) -> ClientFinal:
    """Parse and check client-final-message (its binding and nonce are checked by `verify`).

    Raises:
        ScramError: anything RFC 5802 §7 does not allow.
    """
    text = _utf8(message)
    parts = text.split(",")
    if len(parts) < 3:
        raise ScramError("client-final-message needs c=, r= and p=")
    channel_binding = _base64(_attribute(parts[0], "c"), "channel binding")
    nonce = _attribute(parts[1], "r")
    if not is_nonce(nonce):
        raise ScramError("the nonce is not printable characters")
    _extensions(parts[2:-1])
    proof = _base64(_attribute(parts[-1], "p"), "proof")
    without_proof = text[: len(text) - len(parts[-1]) - 1]
    return ClientFinal(channel_binding, nonce, proof, without_proof)


def verify(
    mechanism: str,
    first: ClientFirst,
    server_first_message: str,
    final: ClientFinal,
    *,
    stored_key: bytes,
    server_key: bytes,
) -> str:
    """Check the final message against the exchange; return server-final-message.

    Raises:
        ScramError: the channel binding does not echo the GS2 header, the nonce is not the
            combined one, or the proof is wrong (a wrong password).
    """
    hash_function = HASHES[mechanism]
    if not stdlib_hmac.compare_digest(final.channel_binding, first.gs2_header.encode()):
        raise ScramError("the channel binding does not echo the GS2 header")
    combined = server_first_message.split(",", 1)[0][2:]
    if final.nonce != combined:
        raise ScramError("the final message's nonce is not the exchange's")
    if len(final.proof) != len(stored_key):
        raise ScramError(f"a proof of {len(final.proof)} bytes, not {len(stored_key)}")
    auth_message = f"{first.bare},{server_first_message},{final.without_proof}".encode()
    client_signature = scramp_hmac(hash_function, stored_key, auth_message)
    client_key = scramp_xor(final.proof, client_signature)
    if not stdlib_hmac.compare_digest(scramp_hash(hash_function, client_key), stored_key):
        raise ScramError("the client proof is wrong")
    server_signature = scramp_hmac(hash_function, server_key, auth_message)
    return "v=" + base64.b64encode(server_signature).decode()


# -- grammar pieces ------------------------------------------------------------------------------


def _utf8(message: bytes) -> str:
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        raise ScramError("a SCRAM message is not UTF-8") from None
    if "\0" in text:
        raise ScramError("a SCRAM message contains NUL")
    return text


def _attribute(part: str, name: str) -> str:
    if not part.startswith(f"{name}=") or len(part) == 2:
        raise ScramError(f"expected a non-empty {name}= attribute, found {part[:16]!r}")
    return part[2:]


def _extensions(parts: list[str]) -> None:
    """attr-val *("," attr-val): an ASCII letter, "=", one or more value characters."""
    for part in parts:
        if len(part) < 3 or part[1] != "=" or not (part[0].isascii() and part[0].isalpha()):
            raise ScramError(f"malformed SCRAM extension {part[:16]!r}")


def _user(saslname: str) -> str:
    """Unescape a saslname (``=2C`` is ",", ``=3D`` is "="; any other "=" is an error), then
    SASLprep it (RFC 4013)."""
    pieces = saslname.split("=")
    unescaped = [pieces[0]]
    for piece in pieces[1:]:
        if piece.startswith("2C"):
            unescaped.append("," + piece[2:])
        elif piece.startswith("3D"):
            unescaped.append("=" + piece[2:])
        else:
            raise ScramError("a user name has an '=' that is not =2C or =3D")
    try:
        user: str = saslprep("".join(unescaped))
    except ScramException:
        raise ScramError("SASLprep refuses the user name") from None
    if not user:
        raise ScramError("the user name is empty")
    return user


def _base64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ScramError(f"the {what} is not base64") from None
