"""Authentication against a live node: bad credentials fail, unauthenticated commands are refused,
and the node keeps serving everyone else."""

from __future__ import annotations

import asyncio

import pytest
from scramp import ScramClient

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import ClientConfig, DcpClient
from changefeed.protocol.errors import AuthError, error_for_status
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import SCRAMP_NAMES, encode_plain
from changefeed.protocol.status import Status
from support.clients import HOST, kv_connect, raw_connection
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)


async def sasl(node: NodeProcess, mechanism: str, user: str, password: str) -> None:
    """Authenticate with exactly ``mechanism``; raises AuthError like the client library."""
    conn = await raw_connection(node, auth=False)
    try:
        if mechanism == "PLAIN":
            opaque = conn.next_opaque()
            request = encode_request(
                Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN", value=encode_plain(user, password)
            )
            response = await conn.request(request, opaque)
            if response.status != Status.SUCCESS:
                raise error_for_status(response.status, response.value.decode())
            return
        client = ScramClient([SCRAMP_NAMES[mechanism]], user, password)
        opaque = conn.next_opaque()
        first = await conn.request(
            encode_request(
                Opcode.SASL_AUTH, opaque=opaque, key=mechanism.encode(),
                value=client.get_client_first().encode(),
            ),
            opaque,
        )  # fmt: skip
        # Unknown users get a decoy salt: the first step succeeds for every name, so it does
        # not tell a caller which users exist; only the proof fails.
        assert first.status == Status.AUTH_CONTINUE, (user, hex(first.status))
        client.set_server_first(first.value.decode())
        opaque = conn.next_opaque()
        final = await conn.request(
            encode_request(
                Opcode.SASL_STEP, opaque=opaque, key=mechanism.encode(),
                value=client.get_client_final().encode(),
            ),
            opaque,
        )  # fmt: skip
        if final.status != Status.SUCCESS:
            raise error_for_status(final.status, final.value.decode())
        client.set_server_final(final.value.decode())
    finally:
        await conn.close()


def test_authentication(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        # The library's own path (best mechanism: SCRAM-SHA512) with a wrong password.
        with pytest.raises(AuthError):
            await kv_connect(node, password="wrong")
        with pytest.raises(AuthError):
            await kv_connect(node, user="nobody")
        with pytest.raises(AuthError):
            async with DcpClient(ClientConfig(HOST, node.port, password="Password")):
                pass
        # Every mechanism, wrong then right.
        for mechanism in ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN"):
            with pytest.raises(AuthError):
                await sasl(node, mechanism, "Administrator", "wrong")
            with pytest.raises(AuthError):
                await sasl(node, mechanism, "ghost", "password")
            await sasl(node, mechanism, "Administrator", "password")

        # Unauthenticated: GET, SET, STAT and DCP_OPEN get EACCESS; the connection stays usable.
        conn = await raw_connection(node, auth=False)
        try:
            for opcode, key in [
                (Opcode.GET, b"k"), (Opcode.SET, b"k"), (Opcode.STAT, b""),
                (Opcode.SELECT_BUCKET, b"default"), (Opcode.DCP_OPEN, b"x"),
            ]:  # fmt: skip
                opaque = conn.next_opaque()
                extras = b"\0" * 8 if opcode in (Opcode.SET, Opcode.DCP_OPEN) else b""
                response = await conn.request(
                    encode_request(opcode, opaque=opaque, key=key, extras=extras), opaque
                )
                assert response.status == Status.EACCESS, (opcode, hex(response.status))
            opaque = conn.next_opaque()
            response = await conn.request(encode_request(Opcode.NOOP, opaque=opaque), opaque)
            assert response.status == Status.SUCCESS
        finally:
            await conn.close()

        # A failed attempt leaves the connection unauthenticated but retryable.
        conn = await raw_connection(node, auth=False)
        try:
            opaque = conn.next_opaque()
            bad = encode_plain("Administrator", "nope")
            request = encode_request(Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN", value=bad)
            assert (await conn.request(request, opaque)).status == Status.AUTH_ERROR
            opaque = conn.next_opaque()
            request = encode_request(Opcode.GET, opaque=opaque, key=b"k")
            assert (await conn.request(request, opaque)).status == Status.EACCESS
        finally:
            await conn.close()

        # The node still serves.
        async with await kv_connect(node) as kv:
            await kv.upsert(b"after", b"auth")
            assert (await kv.get(b"after")).value == b"auth"

    asyncio.run(scenario())
    assert node.alive
    assert node.errors_in_log() == []
