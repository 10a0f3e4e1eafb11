"""A write carrying a durability frame (what the official SDK sends for durability=MAJORITY) on
a node alone: its chain is the node itself, so a majority is the node, and the write is
answered SUCCESS once the node has persisted it (every level waits for the active's
persistence). A command that does not take a level yet is answered DURABILITY_IMPOSSIBLE and
changes nothing — never a false SUCCESS. A bad level is DURABILITY_INVALID_LEVEL."""

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
from support.clients import kv_connect, raw_connection, stats
from support.nodes import NodeFactory


def durable_request(
    opcode: int, key: bytes, payload: bytes, vbuckets: int, value: bytes = b"{}"
) -> bytes:
    extras = {Opcode.SET: STORE_EXTRAS.pack(0, 0), Opcode.TOUCH: b"\x00\x00\x00\x10"}.get(
        opcode, b""
    )
    return encode_frame(
        Magic.ALT_REQUEST,
        opcode,
        vbucket=vbucket_for_key(key, vbuckets),
        opaque=7,
        extras=extras,
        key=key,
        value=value if opcode == Opcode.SET else b"",
        framing_extras=encode_frame_info(FRAME_INFO_DURABILITY, payload),
    )


@pytest.mark.parametrize(
    ("opcode", "payload", "status"),
    [
        (Opcode.SET, b"\x00", Status.DURABILITY_INVALID_LEVEL),
        (Opcode.SET, b"\x09", Status.DURABILITY_INVALID_LEVEL),
        (Opcode.TOUCH, b"\x01", Status.DURABILITY_IMPOSSIBLE),  # TOUCH takes no level
    ],
)
def test_refused_durable_writes_change_nothing(
    nodes: NodeFactory, opcode: int, payload: bytes, status: Status
) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        kv = await kv_connect(node)
        conn = await raw_connection(node)
        try:
            if opcode == Opcode.TOUCH:
                before = await kv.upsert(b"doc", b"before")
            response = await conn.request(durable_request(opcode, b"doc", payload, 4), 7)
            assert response.status == status, hex(response.status)
            if opcode == Opcode.TOUCH:
                assert (await kv.get(b"doc")).cas == before.cas  # not touched
            else:
                with pytest.raises(KeyNotFoundError):  # not written
                    await kv.get(b"doc")
        finally:
            await conn.close()
            await kv.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "payload",
    [b"\x01", b"\x02", b"\x03\x27\x10"],  # majority, majorityAndPersistActive, persistToMajority
    ids=["majority", "majorityAndPersistActive", "persistToMajority-10s"],
)
def test_a_node_alone_honours_durable_writes_once_persisted(
    nodes: NodeFactory, payload: bytes
) -> None:
    node = nodes(vbuckets=4)
    vb = vbucket_for_key(b"doc", 4)

    async def scenario() -> None:
        kv = await kv_connect(node)
        conn = await raw_connection(node)
        try:
            response = await conn.request(durable_request(Opcode.SET, b"doc", payload, 4), 7)
            seqnos = await stats(conn, f"vbucket-seqno {vb}")
            assert response.status == Status.SUCCESS, hex(response.status)
            assert int(seqnos[f"vb_{vb}:high_seqno"]) == 2  # prepare at 1, its commit at 2
            written = await kv.get(b"doc")
            assert (written.value, written.cas) == (b"{}", response.cas)
            # Acknowledged only once on disk: the persisted seqno covers the prepare (seqno 1;
            # its commit is 2). Fetched before anything else could persist more.
            assert int(seqnos[f"vb_{vb}:last_persisted_seqno"]) >= 1
            response = await conn.request(durable_request(Opcode.DELETE, b"doc", payload, 4), 7)
            assert response.status == Status.SUCCESS, hex(response.status)
            with pytest.raises(KeyNotFoundError):
                await kv.get(b"doc")
        finally:
            await conn.close()
            await kv.close()

    asyncio.run(scenario())
