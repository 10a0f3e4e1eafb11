"""A read that filled the event loop's whole read buffer waits for the reads right behind it
(one loop iteration) before its requests are dispatched: a pipelining client's burst is applied
as one longer run of SETs, answered in one write, in order. Nothing received is lost when the
connection ends while a burst waits."""

from __future__ import annotations

import asyncio
from pathlib import Path

from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.vbmap import vbucket_for_key
from unit.server.test_reply_batching import RecordingTransport, replies

READ_BYTES = 256 * 1024  # what one socket read of the loop takes at most
VBUCKETS = 8


def sets(first: int, count: int) -> bytes:
    return b"".join(
        encode_store(
            StoreCommand(
                Opcode.SET, vbucket_for_key(b"k%05d" % n, VBUCKETS), n, b"k%05d" % n, b"v" * 100
            )
        )
        for n in range(first, first + count)
    )


async def logged_in(tmp_path: Path) -> tuple[Bucket, ClientConnection, RecordingTransport]:
    users = Users()
    users.add("u", "p")
    config = NodeConfig(data_dir=tmp_path, vbuckets=VBUCKETS, durable=False)
    bucket = Bucket.open(config)
    conn = ClientConnection(ServerContext(config, users, bucket))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN",
                                      value=encode_plain("u", "p")))  # fmt: skip
    while not transport.writes:  # the password is checked off the loop
        await asyncio.sleep(0.01)
    conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
    transport.writes.clear()
    return bucket, conn, transport


def close(bucket: Bucket) -> None:
    for vbucket in bucket.vbuckets.values():
        vbucket.close()
    bucket.store.close()


def test_a_burst_of_full_reads_is_dispatched_as_one_batch(tmp_path: Path) -> None:
    burst = sets(0, 5000)  # ~750 KiB: two full reads and a short one
    chunks = [burst[:READ_BYTES], burst[READ_BYTES : 2 * READ_BYTES], burst[2 * READ_BYTES :]]
    assert len(chunks[2]) < READ_BYTES

    async def scenario() -> tuple[list[int], list[bytes], int]:
        bucket, conn, transport = await logged_in(tmp_path)
        seen = []
        for chunk in chunks:  # as the loop delivers them, in one iteration
            conn.data_received(chunk)
            seen.append(len(transport.writes))
        writes = list(transport.writes)
        high = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        close(bucket)
        return seen, writes, high

    seen, writes, high = asyncio.run(scenario())
    assert seen == [0, 0, 1]  # the full reads waited; the short one ended the burst
    got = replies(b"".join(writes))
    assert [r.opaque for r in got] == list(range(5000))
    assert all(r.status == Status.SUCCESS for r in got)
    assert high == 5000


def test_a_waiting_burst_is_dispatched_in_the_same_loop_iteration(tmp_path: Path) -> None:
    burst = sets(0, 2500)
    assert len(burst) >= READ_BYTES

    async def scenario() -> tuple[int, int, int]:
        bucket, conn, transport = await logged_in(tmp_path)
        conn.data_received(burst[:READ_BYTES])  # the burst ended exactly at a full read
        before = len(transport.writes)
        await asyncio.sleep(0)  # one loop iteration
        answered = len(replies(b"".join(transport.writes)))
        conn.data_received(burst[READ_BYTES:])
        high = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        close(bucket)
        return before, answered, high

    before, answered, high = asyncio.run(scenario())
    assert before == 0
    assert answered == READ_BYTES // len(sets(0, 1))  # every whole request of the read
    assert high == 2500


def test_a_burst_waiting_when_the_connection_ends_is_applied(tmp_path: Path) -> None:
    burst = sets(0, 2500)

    async def scenario() -> int:
        bucket, conn, _ = await logged_in(tmp_path)
        conn.data_received(burst[:READ_BYTES])
        conn.connection_lost(None)
        high = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        close(bucket)
        return high

    assert asyncio.run(scenario()) == READ_BYTES // len(sets(0, 1))
