"""A raw client pipelines durable SETs (flexible magic, a durability frame info) and plain SETs
in blocks, in one write and in writes of 997 bytes: every write is answered SUCCESS, each GET
after them reads the value written, and the plain SETs still go through request windows.

The connection sends the request after a durable SET straight to the per-frame path (a run
never takes a SET with framing extras, and the next one is most likely another); a plain SET
there is served per frame, and the ones after it are taken as runs again (`STAT kv_window`
counts them). A node alone meets `majority` once it has persisted the prepare."""

from __future__ import annotations

import asyncio
import struct

from changefeed.cli.node_process import HOST
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import (
    DurabilityLevel,
    DurabilityRequirement,
    encode_durability,
)
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import AGENT, BUCKET, PASSWORD, USER, stats
from support.nodes import NodeFactory

VBUCKETS = 4
STORE_EXTRAS = struct.Struct(">II")
FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.SYNC_REPLICATION)
MAJORITY = encode_durability(DurabilityRequirement(DurabilityLevel.MAJORITY, 10_000))
BLOCKS = (("durable", 60), ("plain", 80), ("durable", 40), ("plain", 80))


def writes(prefix: bytes) -> list[tuple[bool, bytes, bytes]]:
    """(durable?, key, value) in request order, every key new (a write to a key whose durable
    write is pending is refused SYNC_WRITE_IN_PROGRESS, rightly)."""
    out = []
    for block, (kind, count) in enumerate(BLOCKS):
        for i in range(count):
            key = prefix + b"b%d-k%d" % (block, i)
            out.append((kind == "durable", key, b"%s-%d-%d" % (kind.encode(), block, i)))
    return out


def encode_write(durable: bool, key: bytes, value: bytes, opaque: int) -> bytes:
    vb = vbucket_for_key(key, VBUCKETS)
    return encode_frame(
        Magic.ALT_REQUEST if durable else Magic.REQUEST, Opcode.SET, vbucket=vb, opaque=opaque,
        key=key, value=value, extras=STORE_EXTRAS.pack(0, 0),
        framing_extras=MAJORITY if durable else b"",
    )  # fmt: skip


async def send_all(conn: Connection, frames: list[bytes], chunk: int | None) -> None:
    data = b"".join(frames)
    if chunk is None:
        conn.send(data)
        return
    for at in range(0, len(data), chunk):
        conn.send(data[at : at + chunk])
        await asyncio.sleep(0)


def test_durable_and_plain_sets_pipelined_are_answered_and_plain_ones_still_batch(
    nodes: NodeFactory,
) -> None:
    node = nodes(vbuckets=VBUCKETS)

    async def scenario() -> None:
        conn = await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
        try:
            for prefix, chunk in ((b"one:", None), (b"chunks:", 997)):
                before = await stats(conn, "kv_window")
                steps = writes(prefix)
                opaques = [conn.next_opaque() for _ in steps]
                futures = [conn.expect(o) for o in opaques]
                frames = [encode_write(*s, o) for s, o in zip(steps, opaques, strict=True)]
                await send_all(conn, frames, chunk)
                replies: list[Frame] = await asyncio.wait_for(asyncio.gather(*futures), 60)
                for step, reply in zip(steps, replies, strict=True):
                    assert reply.status == Status.SUCCESS, (step, reply)
                for _, key, value in steps:
                    opaque = conn.next_opaque()
                    got = conn.expect(opaque)
                    vb = vbucket_for_key(key, VBUCKETS)
                    conn.send(encode_frame(Magic.REQUEST, Opcode.GET, vbucket=vb,
                                           opaque=opaque, key=key))  # fmt: skip
                    reply = await asyncio.wait_for(got, 60)
                    assert (reply.status, reply.value) == (Status.SUCCESS, value), key
                after = await stats(conn, "kv_window")
                went = int(after["kv_window_sets"]) - int(before.get("kv_window_sets", "0"))
                plain = sum(1 for durable, *_ in steps if not durable)
                # At most the first plain SET of each block goes per frame.
                plain_blocks = sum(1 for kind, _ in BLOCKS if kind == "plain")
                assert plain - plain_blocks <= went <= plain, (prefix, went, plain)
        finally:
            await conn.close()

    asyncio.run(scenario())
