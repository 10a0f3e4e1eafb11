"""The node's batched SET path (plain SETs taken as a run) answers and stores exactly what the
per-frame path does.

The model is the node itself: the same pipelined workload is sent twice, once as classic
requests (plain SETs go through `take_set_run` / `Bucket.set_run`) and once with the alt
request magic and no framing extras (every frame through the per-frame dispatcher). Keys of
the two copies differ only by prefix. The replies must match status for status in order, and
the documents (value, flags, expiry, datatype, rev_seqno, deleted) key for key; mutation
tokens must number each vbucket's writes consecutively in request order.
"""

from __future__ import annotations

import asyncio
import random
import re
import struct

from changefeed.cli.node_process import HOST
from changefeed.consumer.handshake import connect
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.kv import decode_mutation_token
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import AGENT, BUCKET, PASSWORD, USER
from support.consumer import Change, server_state
from support.nodes import NodeFactory

VBUCKETS = 8
STORE_EXTRAS = struct.Struct(">II")
FEATURES = (
    Feature.XERROR,
    Feature.SELECT_BUCKET,
    Feature.JSON,
    Feature.MUTATION_SEQNO,
    Feature.ALT_REQUEST_SUPPORT,
)


def plan(rng: random.Random, count: int) -> list[tuple[str, bytes, int, int, int, bytes]]:
    """(kind, key suffix, flags, expiry, datatype, value) per request, in send order."""
    pool = [b"dup-%d" % i for i in range(12)]
    out = []
    for i in range(count):
        kind = rng.choice(["new"] * 6 + ["dup"] * 6 + ["badvb", "locked", "longkey", "bigkey",
                                                      "cas", "noop", "get"])  # fmt: skip
        suffix = {
            "dup": rng.choice(pool),
            "locked": b"locked",
            "longkey": b"L" * 248,  # 250 with the prefix: the longest key allowed
            "bigkey": b"B" * 249,  # 251: refused by the per-frame decoder
        }.get(kind, b"k-%d" % i)
        expiry = rng.choice([0, 0, 100, 2_000_000_000])
        value = b'{"i": %d}' % i if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 40))
        datatype = 1 if value.startswith(b"{") else 0
        out.append((kind, suffix, rng.getrandbits(32), expiry, datatype, value))
    return out


def encode(
    magic: int, prefix: bytes, opaque: int, step: tuple[str, bytes, int, int, int, bytes]
) -> bytes:
    kind, suffix, flags, expiry, datatype, value = step
    key = prefix + suffix
    if kind == "noop":
        return encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=opaque)
    if kind == "get":
        vb = vbucket_for_key(prefix + b"dup-0", VBUCKETS)
        return encode_frame(magic, Opcode.GET, vbucket=vb, opaque=opaque, key=prefix + b"dup-0")
    vb = 200 if kind == "badvb" else vbucket_for_key(key, VBUCKETS)
    return encode_frame(
        magic, Opcode.SET, vbucket=vb, opaque=opaque, key=key, value=value, datatype=datatype,
        cas=12345 if kind == "cas" else 0, extras=STORE_EXTRAS.pack(flags, expiry),
    )  # fmt: skip


def document(c: Change) -> tuple[object, ...]:
    """Everything of a stored version but what differs by copy: seqno, CAS, the key's vbucket."""
    return (c.value, c.flags, c.expiry, c.datatype, c.rev_seqno, c.deleted)


def test_set_run_matches_the_per_frame_path(nodes: NodeFactory, rng: random.Random) -> None:
    node = nodes(vbuckets=VBUCKETS)
    steps = plan(rng, 600)

    async def scenario() -> dict[bytes, list[Frame]]:
        conn = await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
        replies: dict[bytes, list[Frame]] = {}
        try:
            for prefix in (b"a:", b"b:"):  # the same locked document in both namespaces
                key = prefix + b"locked"
                vb = vbucket_for_key(key, VBUCKETS)
                for opcode, extras in ((Opcode.SET, bytes(8)), (Opcode.GET_LOCKED, b"\0\0\0\x1e")):
                    opaque = conn.next_opaque()
                    request = encode_frame(Magic.REQUEST, opcode, vbucket=vb, opaque=opaque,
                                           key=key, extras=extras)  # fmt: skip
                    assert (await conn.request(request, opaque)).status == Status.SUCCESS
            for prefix, magic in ((b"a:", Magic.REQUEST), (b"b:", Magic.ALT_REQUEST)):
                opaques = [conn.next_opaque() for _ in steps]
                futures = [conn.expect(o) for o in opaques]
                conn.send(
                    b"".join(
                        encode(magic, prefix, o, s) for o, s in zip(opaques, steps, strict=True)
                    )
                )
                replies[prefix] = list(await asyncio.wait_for(asyncio.gather(*futures), 60))
        finally:
            await conn.close()
        return replies

    replies = asyncio.run(scenario())
    fast, general = replies[b"a:"], replies[b"b:"]
    statuses = [f.status for f in fast]
    assert statuses == [f.status for f in general]
    kinds = [s[0] for s in steps]
    # Every kind of outcome was exercised (the plan is random, so check it did its job).
    by_kind = {kind: {statuses[i] for i, k in enumerate(kinds) if k == kind} for kind in set(kinds)}
    assert by_kind["new"] == {Status.SUCCESS}, by_kind
    assert by_kind["badvb"] == {Status.NOT_MY_VBUCKET}, by_kind
    assert by_kind["locked"] == {Status.LOCKED}, by_kind
    assert by_kind["bigkey"] == {Status.EINVAL}, by_kind
    assert by_kind["cas"] == {Status.KEY_ENOENT} or by_kind["cas"] <= {
        Status.KEY_ENOENT,
        Status.KEY_EEXISTS,
    }
    for a, b in zip(fast, general, strict=True):
        assert a.opcode == b.opcode and a.datatype == b.datatype
        if a.status == Status.NOT_MY_VBUCKET:
            assert a.value == b.value  # the map
        elif a.status != Status.SUCCESS:
            same = re.sub(rb"vb \d+", b"vb N", a.value.replace(b"a:", b"b:"))
            assert same == re.sub(rb"vb \d+", b"vb N", b.value), (a, b)
    # Mutation tokens: per vbucket, consecutive seqnos in request order, one vb_uuid.
    for prefix, run in ((b"a:", fast), (b"b:", general)):
        seqnos: dict[int, list[int]] = {}
        uuids: dict[int, set[int]] = {}
        for step, reply in zip(steps, run, strict=True):
            if reply.opcode != Opcode.SET or reply.status != Status.SUCCESS:
                continue
            token = decode_mutation_token(reply.extras)
            assert token is not None, reply
            vb = vbucket_for_key(prefix + step[1], VBUCKETS)
            seqnos.setdefault(vb, []).append(token[1])
            uuids.setdefault(vb, set()).add(token[0])
        for vb, got in seqnos.items():
            assert got == list(range(got[0], got[0] + len(got))), (prefix, vb, got)
            assert len(uuids[vb]) == 1, uuids[vb]
    truth = asyncio.run(server_state(node)).latest()
    compared = 0
    for key, change in truth.items():
        if not key.startswith(b"a:"):
            continue
        other = truth[b"b:" + key[2:]]
        assert document(change) == document(other), key
        assert change.vbucket == vbucket_for_key(key, VBUCKETS)
        compared += 1
    assert compared >= 100, compared
    assert {k[2:] for k in truth if k.startswith(b"a:")} == {
        k[2:] for k in truth if k.startswith(b"b:")
    }
