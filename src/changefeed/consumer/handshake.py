"""Connection set-up: HELLO, SASL, SELECT_BUCKET (dcp-wire.md §3), in one place.

``handshake`` runs the three steps on an open connection and ``connect`` opens one and runs
them: every client in the package (``KvClient``, ``DcpClient``, the Spark planner, ``changefeed
stats``), the tests and the benchmarks set up their connections through these two. The steps
stay public for tests that stop part-way on purpose (an unauthenticated connection, a failed
login). SCRAM uses ``scramp``; PLAIN is for servers that offer nothing better.

What it does not do: retry, reconnect, or send anything after SELECT_BUCKET (DCP_OPEN and the
rest belong to the clients).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable

from scramp import ScramClient

from changefeed.consumer.connection import Connection, ConnectionClosedError, TlsError
from changefeed.protocol.errors import AuthError, error_for_status
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import decode_hello, encode_hello, encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.sasl import SCRAMP_NAMES, decode_mechanisms, encode_plain
from changefeed.protocol.status import Status

MECHANISM_PREFERENCE = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")
# What every connection asks for: extended errors, and SELECT_BUCKET (which handshake sends).
BASE_FEATURES: tuple[int, ...] = (Feature.XERROR, Feature.SELECT_BUCKET)


async def handshake(
    conn: Connection,
    *,
    agent: str,
    user: str | None,
    password: str,
    bucket: str,
    features: Iterable[int] = BASE_FEATURES,
) -> set[int]:
    """HELLO, SASL authentication, SELECT_BUCKET: what a connection does before its first
    command (dcp-wire.md §3).

    Args:
        conn: a connection that has sent nothing yet.
        agent: the HELLO agent name (the node logs it; a DCP client passes its DCP name).
        user, password: the credentials; the best mechanism both sides support is used.
            ``user=None``: no SASL, the connection is authenticated by the client
            certificate its TLS context presented (a node certificate, see
            ``connection.client_tls_context``).
        bucket: the bucket to select.
        features: HELLO features to ask for, in order.

    Returns:
        the features the server enabled.

    Raises:
        AuthError: wrong credentials, or no common SASL mechanism.
        StatusError: HELLO or SELECT_BUCKET refused (e.g. no such bucket).
    """
    enabled = await hello(conn, agent, list(features))
    if user is not None:
        await authenticate(conn, user, password)
    await select_bucket(conn, bucket)
    return enabled


async def connect(
    host: str,
    port: int,
    *,
    agent: str,
    user: str | None,
    password: str,
    bucket: str,
    features: Iterable[int] = BASE_FEATURES,
    timeout_s: float = 10.0,
    tls: ssl.SSLContext | None = None,
) -> Connection:
    """Open a connection and run ``handshake`` on it; it is closed again if any step fails.

    Args:
        host, port: the node (with ``tls``: its TLS port).
        timeout_s: for opening the TCP connection (and the TLS handshake).
        agent, user, password, bucket, features: as ``handshake``.
        tls: connect over TLS with these settings (``connection.client_tls_context``).

    Raises:
        OSError, TimeoutError: the node cannot be reached.
        TlsError: the node's certificate is not trusted (one line saying why), or, with
            ``user=None``, the node refused the client certificate.
        AuthError, StatusError: as ``handshake``.
    """
    conn = await Connection.open(host, port, timeout_s=timeout_s, tls=tls)
    try:
        await handshake(
            conn, agent=agent, user=user, password=password, bucket=bucket, features=features
        )
    except ConnectionClosedError as error:
        await conn.close()
        if tls is None or user is not None or "TLS:" in str(error):
            raise
        # TLS 1.3: a node checks the client certificate after the client's side of the
        # handshake is done, and one it refuses sees the connection closed at its first
        # request (asyncio's TLS server sends no alert). The node's log names the reason.
        raise TlsError(
            f"TLS: {host}:{port} closed the connection after the handshake: it refused this "
            "node's certificate (revoked, or not signed by its --tls-ca; its log says which)"
        ) from None
    except BaseException:
        await conn.close()
        raise
    return conn


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
    """Select ``bucket`` for the commands that follow (after ``authenticate``)."""
    await call(conn, Opcode.SELECT_BUCKET, key=bucket.encode())
