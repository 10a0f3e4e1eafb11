"""A raw client's pipelined mix of SETs, GETs and DELETEs is answered in order, as a simple
dictionary model answers it, and each vbucket's writes take seqnos in request order.

The node gathers such a mix in windows (server/request_window.py): SETs applied in layers
across vbuckets, DELETEs between them, GETs after every write. Few keys over few vbuckets make
a window write keys its GETs read (the window must end there), write one vbucket many times
(many layers) and delete keys twice (KEY_ENOENT). Requests to a vbucket the node does not have
(NOT_MY_VBUCKET) and a NOOP (which ends a window) are mixed in. Everything is one pipeline of
classic frames, sent in one write and again in writes of 997 bytes, so windows form both ways.
"""

from __future__ import annotations

import asyncio
import random
import struct

from changefeed.cli.node_process import HOST
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.kv import decode_mutation_token
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import AGENT, BUCKET, PASSWORD, USER
from support.nodes import NodeFactory

VBUCKETS = 4
STORE_EXTRAS = struct.Struct(">II")
GET_EXTRAS = struct.Struct(">I")
FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.MUTATION_SEQNO)

Step = tuple[str, bytes, bytes, int]  # (kind, key, value, flags)


def plan(rng: random.Random, count: int, prefix: bytes) -> list[Step]:
    keys = [prefix + b"k%d" % i for i in range(24)]
    kinds = ["set"] * 8 + ["get"] * 4 + ["delete"] * 4 + ["badvb", "noop"]
    return [
        (rng.choice(kinds), rng.choice(keys), rng.randbytes(rng.randrange(0, 30)),
         rng.getrandbits(32))
        for _ in range(count)
    ]  # fmt: skip


def encode(step: Step, opaque: int) -> bytes:
    kind, key, value, flags = step
    vb = vbucket_for_key(key, VBUCKETS)
    if kind == "noop":
        return encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=opaque)
    if kind in ("set", "badvb"):
        return encode_frame(
            Magic.REQUEST, Opcode.SET, vbucket=VBUCKETS + 3 if kind == "badvb" else vb,
            opaque=opaque, key=key, value=value, extras=STORE_EXTRAS.pack(flags, 0),
        )  # fmt: skip
    opcode = Opcode.GET if kind == "get" else Opcode.DELETE
    return encode_frame(Magic.REQUEST, opcode, vbucket=vb, opaque=opaque, key=key)


def model(steps: list[Step]) -> list[tuple[int, bytes, int | None]]:
    """(status, GET value, GET flags) per request, in order, from a dictionary."""
    store: dict[bytes, tuple[bytes, int]] = {}
    out: list[tuple[int, bytes, int | None]] = []
    for kind, key, value, flags in steps:
        if kind == "set":
            store[key] = (value, flags)
            out.append((Status.SUCCESS, b"", None))
        elif kind == "get":
            held = store.get(key)
            out.append((Status.KEY_ENOENT, b"", None) if held is None
                       else (Status.SUCCESS, held[0], held[1]))  # fmt: skip
        elif kind == "delete":
            status = Status.SUCCESS if store.pop(key, None) is not None else Status.KEY_ENOENT
            out.append((status, b"", None))
        elif kind == "badvb":
            out.append((Status.NOT_MY_VBUCKET, b"", None))
        else:
            out.append((Status.SUCCESS, b"", None))
    return out


async def pipeline(conn: Connection, steps: list[Step], chunk: int | None) -> list[Frame]:
    opaques = [conn.next_opaque() for _ in steps]
    futures = [conn.expect(o) for o in opaques]
    data = b"".join(encode(s, o) for s, o in zip(steps, opaques, strict=True))
    if chunk is None:
        conn.send(data)
    else:
        for at in range(0, len(data), chunk):
            conn.send(data[at : at + chunk])
            await asyncio.sleep(0)
    return list(await asyncio.wait_for(asyncio.gather(*futures), 60))


def test_a_pipelined_mix_is_answered_in_order_as_the_model(
    nodes: NodeFactory, rng: random.Random
) -> None:
    node = nodes(vbuckets=VBUCKETS)
    runs = {b"one:": None, b"chunks:": 997}  # one write; writes of 997 bytes

    async def scenario() -> dict[bytes, tuple[list[Step], list[Frame]]]:
        conn = await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
        done = {}
        try:
            for prefix, chunk in runs.items():
                steps = plan(rng, 700, prefix)
                done[prefix] = (steps, await pipeline(conn, steps, chunk))
        finally:
            await conn.close()
        return done

    for prefix, (steps, replies) in asyncio.run(scenario()).items():
        expected = model(steps)
        kinds = {kind for kind, *_ in steps}
        assert kinds == {"set", "get", "delete", "badvb", "noop"}, kinds
        seqnos: dict[int, list[int]] = {}
        for index, (step, reply, (status, value, flags)) in enumerate(
            zip(steps, replies, expected, strict=True)
        ):
            where = (prefix, index, step[0], step[1])
            assert reply.status == status, (where, reply)
            if step[0] == "get" and status == Status.SUCCESS:
                assert (reply.value, GET_EXTRAS.unpack(reply.extras)[0]) == (value, flags), where
            if step[0] in ("set", "delete") and status == Status.SUCCESS:
                token = decode_mutation_token(reply.extras)
                assert token is not None, where
                seqnos.setdefault(vbucket_for_key(step[1], VBUCKETS), []).append(token[1])
        # Each vbucket's SETs and DELETEs got consecutive seqnos in request order.
        assert len(seqnos) == VBUCKETS, seqnos.keys()
        for vb, got in seqnos.items():
            assert got == list(range(got[0], got[0] + len(got))), (prefix, vb, got)


def test_replies_arrive_in_request_order(nodes: NodeFactory, rng: random.Random) -> None:
    """The raw client's view: replies come back in the order the requests went, opaque by
    opaque (a client that matches replies by position, as the simplest ones do, works)."""
    node = nodes(vbuckets=VBUCKETS)
    steps = plan(rng, 500, b"order:")

    async def scenario() -> list[int]:
        conn = await connect(
            HOST, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
            features=FEATURES,
        )  # fmt: skip
        order: list[int] = []
        try:
            opaques = [conn.next_opaque() for _ in steps]
            futures = [conn.expect(o) for o in opaques]
            for future, opaque in zip(futures, opaques, strict=True):
                future.add_done_callback(lambda _f, o=opaque: order.append(o))
            conn.send(b"".join(encode(s, o) for s, o in zip(steps, opaques, strict=True)))
            await asyncio.wait_for(asyncio.gather(*futures), 60)
            assert order  # the callbacks ran
            return [order.index(o) for o in opaques]
        finally:
            await conn.close()

    positions = asyncio.run(scenario())
    assert positions == sorted(positions)
