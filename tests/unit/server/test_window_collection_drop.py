"""A window's GET held while replies back up is answered under the collections manifest of
its turn, not of the window's forming: a review found one answered with the document of a
collection dropped meanwhile (its documents stay in the store until compaction purges them).
Two GETs in one window on a Collections connection: the first answer (300 kB) pauses the
transport, the collection is dropped, writing resumes; the second GET must be refused
UNKNOWN_COLLECTION as the per-frame handler refuses it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator
from pathlib import Path

from changefeed.protocol.collections import encode_leb128
from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.storage.keys import stored_key
from support.transports import RecordingTransport, sign_in

BIG = 300_000


class PausingTransport(RecordingTransport):
    """Backs up (pause_writing) at the first large write, as a slow reader's socket does."""

    def __init__(self) -> None:
        super().__init__()
        self.conn: ClientConnection | None = None
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        super().write(data)
        if len(data) > BIG and not self.paused and self.conn is not None:
            self.paused = True
            self.conn.pause_writing()


def answers(data: bytes) -> dict[int, tuple[int, bytes]]:
    """(status, value) of each response, by opaque."""
    out = {}
    while data:
        key_len, extras_len = struct.unpack_from(">HB", data, 2)
        status, body_len, opaque = struct.unpack_from(">HII", data, 6)
        out[opaque] = (status, data[24 + extras_len + key_len : 24 + body_len])
        data = data[24 + body_len :]
    return out


@contextlib.asynccontextmanager
async def collections_connection(
    path: Path, documents: dict[bytes, bytes]
) -> AsyncIterator[tuple[ClientConnection, PausingTransport, Bucket, int]]:
    """A bucket with a collection "c" holding `documents` in vbucket 0, and a signed-in
    connection that negotiated Collections, behind a transport that backs up at a big write.
    Yields (connection, transport, bucket, the collection's id)."""
    config = NodeConfig(data_dir=path, vbuckets=4, durable=False)
    users = Users()
    users.add("u", "p")
    bucket = Bucket.open(config, rng=random.Random(7))
    context = ServerContext(config, users, bucket)
    manifests = context.manifests
    manifests.apply(manifests.current.with_collection("_default", "c"))
    (cid,) = manifests.collection_ids() - {0}
    for key, value in documents.items():
        bucket.store_command(StoreCommand(Opcode.SET, 0, 1, stored_key(cid, key), value))
    conn = ClientConnection(context)
    transport = PausingTransport()
    transport.conn = conn
    conn.connection_made(transport)  # type: ignore[arg-type]
    try:
        await sign_in(conn, transport)
        hello = struct.pack(">H", Feature.COLLECTIONS)
        conn.data_received(encode_request(Opcode.HELLO, opaque=3, key=b"t", value=hello))
        yield conn, transport, bucket, cid
    finally:
        conn.close()
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()


async def answered_after_a_drop(
    conn: ClientConnection, transport: PausingTransport, requests: bytes, last: int
) -> dict[int, tuple[int, bytes]]:
    """Send `requests` (the first answer backs the replies up), drop "c", resume writing;
    the answers once the one with opaque `last` came."""
    conn.data_received(requests)
    assert transport.paused, "the first answer did not back the replies up"
    assert last not in answers(transport.data)  # it waits for its turn
    manifests = conn.context.manifests
    manifests.apply(manifests.current.without_collection("_default", "c"))
    conn.resume_writing()
    async with asyncio.timeout(30):
        while last not in answers(transport.data):
            await asyncio.sleep(0.005)
    return answers(transport.data)


async def scenario(path: Path) -> dict[int, tuple[int, bytes]]:
    documents = {b"a": b"x" * BIG, b"b": b"secret"}
    async with collections_connection(path, documents) as (conn, transport, _, cid):
        prefix = encode_leb128(cid)
        requests = encode_request(
            Opcode.GET, opaque=10, vbucket=0, key=prefix + b"a"
        ) + encode_request(Opcode.GET, opaque=11, vbucket=0, key=prefix + b"b")
        return await answered_after_a_drop(conn, transport, requests, 11)


def test_a_held_get_of_a_dropped_collection_is_refused(tmp_path: Path) -> None:
    got = asyncio.run(scenario(tmp_path))
    assert got[10] == (Status.SUCCESS, b"x" * BIG)
    status, value = got[11]
    assert status == Status.UNKNOWN_COLLECTION, (hex(status), value[:40])
    assert b"secret" not in value


async def held_set_scenario(path: Path) -> tuple[dict[int, tuple[int, bytes]], object]:
    """GET a (300 kB: replies back up), GET b, then SET b: the SET writes a key the window's
    GETs read, so it forms the next window, which waits behind the held GET. The collection
    is dropped; writing resumes."""
    documents = {b"a": b"x" * BIG, b"b": b"before"}
    async with collections_connection(path, documents) as (conn, transport, bucket, cid):
        prefix = encode_leb128(cid)
        requests = (
            encode_request(Opcode.GET, opaque=10, vbucket=0, key=prefix + b"a")
            + encode_request(Opcode.GET, opaque=11, vbucket=0, key=prefix + b"b")
            + encode_store(StoreCommand(Opcode.SET, 0, 12, prefix + b"b", b"after"))
        )
        got = await answered_after_a_drop(conn, transport, requests, 12)
        stored = bucket.vbucket(0).get(stored_key(cid, b"b"))
        return got, None if stored is None else stored.value


def test_a_held_set_of_a_dropped_collection_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """The reviewer's second find: a SET window held behind backed-up replies applied keys
    qualified before the drop, writing into the dropped collection (answered SUCCESS)."""
    got, value = asyncio.run(held_set_scenario(tmp_path))
    assert got[11][0] == Status.UNKNOWN_COLLECTION
    assert got[12][0] == Status.UNKNOWN_COLLECTION, (hex(got[12][0]), got[12][1][:40])
    assert value != b"after"
