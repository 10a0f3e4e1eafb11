"""Replies sent outside a received batch — persistence waits that one flush round ends — go
out in one write per connection, in the order they were answered (they were one write each:
64 a window for a client that waits on every vbucket it wrote)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import (
    StoreCommand,
    encode_request,
    encode_seqno_persistence,
    encode_store,
)
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from support.transports import RecordingTransport

VBUCKETS = 8


def frames(data: bytes) -> list[Frame]:
    reader = FrameReader(1 << 20)
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        out.append(frame)
    return out


def test_waits_ended_by_one_flush_round_are_answered_in_one_write(tmp_path: Path) -> None:
    config = NodeConfig(data_dir=tmp_path, vbuckets=VBUCKETS, durable=False)
    users = Users()
    users.add("u", "p")

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        bucket = Bucket.open(config)
        conn = ClientConnection(ServerContext(config, users, bucket))
        transport = RecordingTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(
            encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain("u", "p"))
        )
        while not transport.writes:  # the password is checked off the loop
            await asyncio.sleep(0.01)
        conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
        # One write per vbucket, then a wait on each: nothing is flushed yet (no flush loop).
        conn.data_received(
            b"".join(
                encode_store(StoreCommand(Opcode.SET, vb, 10 + vb, b"key-%d" % vb, b"v"))
                for vb in range(VBUCKETS)
            )
        )
        conn.data_received(
            b"".join(encode_seqno_persistence(vb, 1, opaque=100 + vb) for vb in range(VBUCKETS))
        )
        await asyncio.sleep(0)
        before = list(transport.writes)
        bucket.start()  # the flusher: one round persists every vbucket
        async with asyncio.timeout(30):
            while sum(len(frames(w)) for w in transport.writes[len(before) :]) < VBUCKETS:
                await asyncio.sleep(0.01)
        after = transport.writes[len(before) :]
        conn.close()
        await bucket.close()
        return before, after

    before, after = asyncio.run(scenario())
    answered = [f for f in frames(b"".join(before)) if f.opaque >= 100]
    assert answered == []  # nothing was persisted before the flusher ran
    assert len(after) == 1, [len(frames(w)) for w in after]
    waits = frames(after[0])
    assert [f.opaque for f in waits] == [100 + vb for vb in range(VBUCKETS)]
    assert {(f.opcode, f.status) for f in waits} == {(Opcode.SEQNO_PERSISTENCE, Status.SUCCESS)}


class PausingTransport(RecordingTransport):
    """Backs up after `high` bytes: tells the connection to stop writing, as asyncio's
    transports do at their high-water mark."""

    def __init__(self, high: int) -> None:
        super().__init__()
        self.high = high
        self.held = 0
        self.protocol: ClientConnection | None = None

    def write(self, data: bytes) -> None:
        super().write(data)
        self.held += len(data)
        if self.held >= self.high and self.protocol is not None:
            self.protocol.pause_writing()


def test_a_windows_gets_stop_at_backpressure_and_resume_in_order(tmp_path: Path) -> None:
    """A window of SETs, GETs and DELETEs whose GET replies back the transport up: the
    connection stops answering, takes no later request, and on resume answers the rest and
    then the later requests, all in request order. Halfway a SET rewrites the key the GETs
    read (that ends the window): the GETs before it still read the old value."""
    config = NodeConfig(data_dir=tmp_path, vbuckets=VBUCKETS, durable=False)
    users = Users()
    users.add("u", "p")
    big, rewritten = b"x" * (64 * 1024), b"y" * (64 * 1024)
    vb = 3

    async def scenario() -> tuple[list[Frame], int]:
        bucket = Bucket.open(config)
        conn = ClientConnection(ServerContext(config, users, bucket))
        transport = PausingTransport(high=1 << 30)
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(
            encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain("u", "p"))
        )
        while not transport.writes:
            await asyncio.sleep(0.01)
        conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
        conn.data_received(encode_store(StoreCommand(Opcode.SET, vb, 3, b"big", big)))
        mark = len(b"".join(transport.writes))
        transport.held, transport.high, transport.protocol = 0, 4 * len(big), conn
        requests = []
        for n in range(20):  # SET, GET (64 KiB reply), DELETE of another key, per step
            requests.append(
                encode_store(StoreCommand(Opcode.SET, vb, 100 + 3 * n, b"k%d" % n, b"v"))
            )
            requests.append(encode_request(Opcode.GET, opaque=101 + 3 * n, vbucket=vb, key=b"big"))
            requests.append(encode_request(Opcode.DELETE, opaque=102 + 3 * n, vbucket=vb,
                                           key=b"k%d" % (n - 1)))  # fmt: skip
            if n == 9:
                requests.append(encode_store(StoreCommand(Opcode.SET, vb, 400, b"big", rewritten)))
        requests.append(encode_request(Opcode.NOOP, opaque=500))
        conn.data_received(b"".join(requests))
        paused_at = len(frames(b"".join(transport.writes)[mark:]))
        for _ in range(40):  # the peer reads: the transport drains, the connection resumes
            if conn.writable.is_set():
                break
            transport.held = 0
            conn.resume_writing()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        conn.close()
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()
        return frames(b"".join(transport.writes)[mark:]), paused_at

    got, paused_at = asyncio.run(scenario())
    assert 0 < paused_at < 62  # it stopped part way, at backpressure
    opaques = [100 + n for n in range(60)]
    assert [f.opaque for f in got] == [*opaques[:30], 400, *opaques[30:], 500]
    assert got[30].status == Status.SUCCESS
    del got[30]
    statuses = [f.status for f in got]
    assert statuses[0:60:3] == [Status.SUCCESS] * 20  # SETs
    gets = [f.value for f in got[1:60:3]]  # every GET, in its place
    assert gets == [big] * 10 + [rewritten] * 10
    assert statuses[2] == Status.KEY_ENOENT  # the DELETE of k-1 (never set)
    assert statuses[5:60:3] == [Status.SUCCESS] * 19  # each DELETE of the key set before it
