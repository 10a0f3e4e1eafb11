"""Connection set-up shared by the KV and DCP clients: HELLO, SASL, SELECT_BUCKET
(dcp-wire.md §3). SCRAM uses ``scramp``; PLAIN is for servers that offer nothing better.
"""

from __future__ import annotations

from scramp import ScramClient

from changefeed.consumer.connection import Connection
from changefeed.protocol.errors import AuthError, error_for_status
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import decode_hello, encode_hello, encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import SCRAMP_NAMES, decode_mechanisms, encode_plain
from changefeed.protocol.status import Status

MECHANISM_PREFERENCE = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")


async def call(
    conn: Connection,
    opcode: int,
    *,
    vbucket: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
) -> Frame:
    """Send one request and return the response; non-success raises its ``StatusError``."""
    opaque = conn.next_opaque()
    request = encode_request(
        opcode, opaque=opaque, vbucket=vbucket, extras=extras, key=key, value=value
    )
    response = await conn.request(request, opaque)
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))
    return response


async def hello(conn: Connection, agent: str, features: list[int]) -> set[int]:
    """Negotiate features; returns the set the server enabled."""
    opaque = conn.next_opaque()
    response = await conn.request(encode_hello(opaque, agent, features), opaque)
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, "HELLO")
    return set(decode_hello(response).features)


async def authenticate(conn: Connection, user: str, password: str) -> str:
    """Authenticate with the best mechanism both sides support; returns its name.

    Raises:
        AuthError: wrong credentials or no common mechanism.
    """
    offered = decode_mechanisms((await call(conn, Opcode.SASL_LIST_MECHS)).value)
    for mechanism in MECHANISM_PREFERENCE:
        if mechanism in offered:
            break
    else:
        raise AuthError(f"no common SASL mechanism (server offers {offered})")
    if mechanism == "PLAIN":
        await _sasl(conn, Opcode.SASL_AUTH, mechanism, encode_plain(user, password))
        return mechanism
    client = ScramClient([SCRAMP_NAMES[mechanism]], user, password)
    first = await _sasl(
        conn, Opcode.SASL_AUTH, mechanism, client.get_client_first().encode(), final=False
    )
    client.set_server_first(first.value.decode())
    last = await _sasl(conn, Opcode.SASL_STEP, mechanism, client.get_client_final().encode())
    client.set_server_final(last.value.decode())  # verifies the server's signature
    return mechanism


async def _sasl(
    conn: Connection, opcode: int, mechanism: str, payload: bytes, *, final: bool = True
) -> Frame:
    opaque = conn.next_opaque()
    request = encode_request(opcode, opaque=opaque, key=mechanism.encode(), value=payload)
    response = await conn.request(request, opaque)
    expected = Status.SUCCESS if final else Status.AUTH_CONTINUE
    if response.status != expected:
        raise AuthError(response.value.decode(errors="replace"), status=response.status)
    return response


async def select_bucket(conn: Connection, bucket: str) -> None:
    await call(conn, Opcode.SELECT_BUCKET, key=bucket.encode())
