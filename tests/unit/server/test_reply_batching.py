"""The replies of one received batch of requests go out in one write, in request order; a batch
whose replies grow past REPLY_BATCH_BYTES_MAX is written in pieces (so backpressure applies)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from changefeed import limits
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.vbmap import vbucket_for_key
from support.transports import RecordingTransport


def replies(data: bytes) -> list[Frame]:
    reader = FrameReader(1 << 26)
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        out.append(frame)
    return out


def test_a_batch_of_sets_is_answered_with_one_write_in_order(tmp_path: Path) -> None:
    config = NodeConfig(data_dir=tmp_path, vbuckets=8, durable=False)
    users = Users()
    users.add("u", "p")

    async def scenario() -> tuple[int, list[Frame], list[Frame], int]:
        bucket = Bucket.open(config)
        conn = ClientConnection(ServerContext(config, users, bucket))
        transport = RecordingTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        plain = encode_plain("u", "p")
        conn.data_received(encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=plain))
        while not transport.writes:  # the password is checked off the loop
            await asyncio.sleep(0.01)
        conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
        before = len(transport.writes)
        sets = b"".join(
            encode_store(
                StoreCommand(Opcode.SET, vbucket_for_key(b"k%d" % n, 8), 100 + n, b"k%d" % n, b"v")
            )
            for n in range(1000)
        )
        conn.data_received(sets)
        small = transport.writes[before:]
        count = len(small)
        # A batch of GETs whose replies pass REPLY_BATCH_BYTES_MAX is written in pieces.
        big = b"x" * (100 * 1024)
        vb = vbucket_for_key(b"big", 8)
        conn.data_received(encode_store(StoreCommand(Opcode.SET, vb, 5000, b"big", big)))
        mark = len(transport.writes)
        gets = b"".join(
            encode_request(Opcode.GET, opaque=6000 + n, vbucket=vb, key=b"big") for n in range(10)
        )
        conn.data_received(gets)
        pieces = transport.writes[mark:]
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()
        got = [reply for piece in pieces for reply in replies(piece)]
        return count, replies(b"".join(small)), got, len(pieces)

    count, answered, got, writes = asyncio.run(scenario())
    assert count == 1  # 1000 replies, one write (was one write per reply)
    assert [r.opaque for r in answered] == [100 + n for n in range(1000)]
    assert all(r.status == Status.SUCCESS for r in answered)
    assert [r.opaque for r in got] == [6000 + n for n in range(10)]
    expected = -(-10 * (100 * 1024) // limits.REPLY_BATCH_BYTES_MAX)  # ceil: about 4 pieces
    assert 2 <= writes <= expected + 1, writes
