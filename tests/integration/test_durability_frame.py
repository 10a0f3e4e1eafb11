"""A write carrying a durability frame (what the official SDK sends for durability=MAJORITY)
is answered DURABILITY_IMPOSSIBLE while the node has no replicas — never a false SUCCESS —
and the write does not happen. A bad level is DURABILITY_INVALID_LEVEL."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.frame_info import FRAME_INFO_DURABILITY, encode_frame_info
from changefeed.protocol.kv import STORE_EXTRAS
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import kv_connect, raw_connection
from support.nodes import NodeFactory


def durable_request(opcode: int, key: bytes, payload: bytes, vbuckets: int) -> bytes:
    extras = STORE_EXTRAS.pack(0, 0) if opcode == Opcode.SET else b""
    return encode_frame(
        Magic.ALT_REQUEST,
        opcode,
        vbucket=vbucket_for_key(key, vbuckets),
        opaque=7,
        extras=extras,
        key=key,
        value=b"{}" if opcode == Opcode.SET else b"",
        framing_extras=encode_frame_info(FRAME_INFO_DURABILITY, payload),
    )


@pytest.mark.parametrize(
    ("opcode", "payload", "status"),
    [
        (Opcode.SET, b"\x01", Status.DURABILITY_IMPOSSIBLE),  # majority
        (Opcode.SET, b"\x03\x27\x10", Status.DURABILITY_IMPOSSIBLE),  # persistToMajority, 10 s
        (Opcode.DELETE, b"\x02", Status.DURABILITY_IMPOSSIBLE),  # majorityAndPersistActive
        (Opcode.SET, b"\x00", Status.DURABILITY_INVALID_LEVEL),
        (Opcode.SET, b"\x09", Status.DURABILITY_INVALID_LEVEL),
    ],
)
def test_durable_writes_are_refused_until_replicas_exist(
    nodes: NodeFactory, opcode: int, payload: bytes, status: Status
) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        kv = await kv_connect(node)
        conn = await raw_connection(node)
        try:
            if opcode == Opcode.DELETE:
                await kv.upsert(b"doc", b"before")
            response = await conn.request(durable_request(opcode, b"doc", payload, 4), 7)
            assert response.status == status, hex(response.status)
            if opcode == Opcode.DELETE:
                assert (await kv.get(b"doc")).value == b"before"  # not deleted
            else:
                with pytest.raises(KeyNotFoundError):  # not written
                    await kv.get(b"doc")
        finally:
            await conn.close()
            await kv.close()

    asyncio.run(scenario())
