"""A raw client that negotiated HELLO Collections (as every Couchbase SDK does) pipelines SETs,
GETs and DELETEs in the default collection, a named collection with a maxTTL and a collection
the manifest does not hold: it gets the answers a dictionary keyed by (collection, key) gives,
its requests go through request windows (server/request_window.py, STAT ``kv_window``), and the
named collection's SETs get its maxTTL as the per-request path gives it.

The same keys are used in both collections, so a window that mixed them up (compared wire keys
instead of stored keys, or stored one collection's key in the other) answers differently.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time

import pytest

from changefeed.cli.node_process import HOST
from changefeed.consumer.collections_admin import edit_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.collections import encode_leb128
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.kv_ops import decode_get_meta_extras
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import AGENT, BUCKET, PASSWORD, USER, stats
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(120)
VBUCKETS = 4
MAX_TTL_S = 3600
UNKNOWN = 77  # a collection id the manifest does not hold
STORE_EXTRAS = struct.Struct(">II")
GET_EXTRAS = struct.Struct(">I")
FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS)

Step = tuple[str, int, bytes, bytes, int]  # (kind, collection id, key, value, flags)


def plan(rng: random.Random, count: int, cids: list[int], prefix: bytes) -> list[Step]:
    keys = [prefix + b"k%d" % i for i in range(16)]
    kinds = ["set"] * 6 + ["get"] * 3 + ["delete"] * 3
    return [
        (rng.choice(kinds), rng.choice(cids), rng.choice(keys), rng.randbytes(rng.randrange(30)),
         rng.getrandbits(32))
        for _ in range(count)
    ]  # fmt: skip


def encode(step: Step, opaque: int) -> bytes:
    kind, cid, key, value, flags = step
    vb = vbucket_for_key(key, VBUCKETS)  # the SDK hashes the key without its collection id
    wire = encode_leb128(cid) + key
    if kind == "set":
        extras = STORE_EXTRAS.pack(flags, 0)
        return encode_frame(
            Magic.REQUEST, Opcode.SET, vbucket=vb, opaque=opaque, key=wire, value=value,
            extras=extras,
        )  # fmt: skip
    opcode = Opcode.GET if kind == "get" else Opcode.DELETE
    return encode_frame(Magic.REQUEST, opcode, vbucket=vb, opaque=opaque, key=wire)


def model(steps: list[Step]) -> list[tuple[int, bytes, int | None]]:
    """(status, GET value, GET flags) per request, from a dictionary of (collection, key)."""
    store: dict[tuple[int, bytes], tuple[bytes, int]] = {}
    out: list[tuple[int, bytes, int | None]] = []
    for kind, cid, key, value, flags in steps:
        if cid == UNKNOWN:
            out.append((Status.UNKNOWN_COLLECTION, b"", None))
        elif kind == "set":
            store[cid, key] = (value, flags)
            out.append((Status.SUCCESS, b"", None))
        elif kind == "get":
            held = store.get((cid, key))
            out.append((Status.KEY_ENOENT, b"", None) if held is None
                       else (Status.SUCCESS, held[0], held[1]))  # fmt: skip
        else:
            found = store.pop((cid, key), None) is not None
            out.append((Status.SUCCESS if found else Status.KEY_ENOENT, b"", None))
    return out


async def pipeline(conn: Connection, steps: list[Step], chunk: int | None) -> list[Frame]:
    opaques = [conn.next_opaque() for _ in steps]
    futures = [conn.expect(o) for o in opaques]
    data = b"".join(encode(s, o) for s, o in zip(steps, opaques, strict=True))
    for at in range(0, len(data), chunk or len(data)):
        conn.send(data[at : at + (chunk or len(data))])
        await asyncio.sleep(0)
    return list(await asyncio.wait_for(asyncio.gather(*futures), 60))


def test_a_collections_clients_pipelined_mix_goes_through_windows_as_the_model(
    nodes: NodeFactory, rng: random.Random
) -> None:
    node = nodes(vbuckets=VBUCKETS)

    async def scenario() -> None:
        conn = await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
        try:
            manifest = await edit_manifest(
                conn, lambda m: m.with_scope("s").with_collection("s", "c", max_ttl=MAX_TTL_S)
            )
            named = manifest.resolve("s.c")[1]
            assert named is not None
            before = await stats(conn, "kv_window")
            # Known collections only (whole windows), then with an unknown one mixed in
            # (its runs and frames are answered one by one), in one write and in chunks.
            for cids, chunk in (([0, named.uid], None), ([0, named.uid, UNKNOWN], 997)):
                steps = plan(rng, 600, cids, b"%d:" % len(cids))
                started = time.time()
                replies = await pipeline(conn, steps, chunk)
                for index, (step, reply, (status, value, flags)) in enumerate(
                    zip(steps, replies, model(steps), strict=True)
                ):
                    where = (index, step[:3], cids)
                    assert reply.status == status, (where, reply)
                    if step[0] == "get" and status == Status.SUCCESS:
                        got = (reply.value, GET_EXTRAS.unpack(reply.extras)[0])
                        assert got == (value, flags), where
                await check_expiries(conn, steps, named.uid, started)
            after = await stats(conn, "kv_window")
        finally:
            await conn.close()
        went = {name: int(after[name]) - int(before.get(name, "0")) for name in after}
        # Every known-collection request of the first pipeline (and most of the second) went
        # through a window: at least the first pipeline's count of each kind.
        assert went["kv_window_windows"] > 0, went
        assert went["kv_window_sets"] >= 300 and went["kv_window_gets"] >= 100, went
        assert went["kv_window_deletes"] >= 100, went

    asyncio.run(scenario())


async def check_expiries(conn: Connection, steps: list[Step], named: int, started: float) -> None:
    """The last SET of each live key got its collection's maxTTL (none in the default)."""
    live: dict[tuple[int, bytes], bool] = {}
    for kind, cid, key, _, _ in steps:
        if cid != UNKNOWN and kind != "get":
            live[cid, key] = kind == "set"
    for (cid, key), alive in live.items():
        if not alive:
            continue
        opaque = conn.next_opaque()
        future = conn.expect(opaque)
        wire = encode_leb128(cid) + key
        vb = vbucket_for_key(key, VBUCKETS)
        conn.send(encode_frame(Magic.REQUEST, Opcode.GET_META, vbucket=vb, opaque=opaque,
                               key=wire))  # fmt: skip
        reply = await asyncio.wait_for(future, 10)
        assert reply.status == Status.SUCCESS, (cid, key, reply)
        expiry = decode_get_meta_extras(reply.extras).expiry
        if cid == named:
            assert int(started) <= expiry - MAX_TTL_S <= time.time() + 1, (key, expiry)
        else:
            assert expiry == 0, (cid, key, expiry)
