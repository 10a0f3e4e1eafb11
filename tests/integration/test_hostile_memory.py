"""Memory stays bounded whatever a client does (invariant 5), measured as the node's RSS.

Each test replays a finding of the hardening review against a node process over raw sockets:
before the bounds, 60 pipelined GETs of a 5 MiB value that the client never reads cost
+294 MiB, 200 connections each holding 1 MiB of a declared 20 MiB SET cost +190 MiB, and a
DCP connection with 64 backfilling streams that never reads cost +245 MiB. The bounds are in
limits.py; each test states the figure it allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from changefeed import limits
from changefeed.cli.node_process import NodeProcess
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamRequest,
    encode_dcp_control,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.kv import STORE_EXTRAS, encode_request
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key
from support.clients import HOST, PASSWORD, USER, kv_connect
from support.nodes import NodeFactory

MIB = 1024 * 1024
pytestmark = pytest.mark.timeout(240)


def authenticated_socket(node: NodeProcess) -> socket.socket:
    """A blocking socket past SASL PLAIN and SELECT_BUCKET (replies read and checked)."""
    sock = socket.create_connection((HOST, node.port), timeout=10)
    reader = FrameReader()
    for opaque, request in enumerate(
        (
            encode_request(
                Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain(USER, PASSWORD)
            ),
            encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"),
        ),
        start=1,
    ):
        sock.sendall(request)
        while (frame := reader.next_frame()) is NEED_DATA:
            reader.feed(sock.recv(65536))
        assert frame.status == Status.SUCCESS, (opaque, frame)  # type: ignore[union-attr]
    return sock


@contextlib.contextmanager
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def settle_rss(node: NodeProcess, seconds: float = 2.0) -> int:
    """The node's peak anonymous RSS over `seconds` (it may still be growing when sampled
    once). Anonymous memory — heap, buffers — is what a client could make the node hold; the
    pages of the memory-mapped store (RssFile) are the kernel's cache of the data file, whose
    count depends on where LMDB placed the records, and the kernel can drop them at will."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, node.status_kib("RssAnon") * 1024)
        time.sleep(0.1)
    return peak


def test_pipelined_gets_that_are_never_read_hold_bounded_replies(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def load() -> None:
        kv = await kv_connect(node)
        try:
            await kv.upsert(b"big", b"x" * (5 * MIB))
        finally:
            await kv.close()

    asyncio.run(load())
    vb = vbucket_for_key(b"big", 4)
    with sockets() as opened:
        sock = authenticated_socket(node)
        opened.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        before = settle_rss(node, 0.5)
        gets = b"".join(
            encode_request(Opcode.GET, opaque=100 + n, vbucket=vb, key=b"big") for n in range(60)
        )
        sock.sendall(gets)  # 60 x 5 MiB of replies; the client never reads one
        grown = settle_rss(node) - before
    allowed = limits.WRITE_BUFFER_HIGH_BYTES + 4 * 5 * MIB  # the buffer, a few replies in flight
    print(f"RSS grew {grown / MIB:.1f} MiB (allowed {allowed / MIB:.0f})")
    assert grown < allowed, f"RSS grew {grown / MIB:.0f} MiB (allowed {allowed / MIB:.0f})"
    assert node.alive


def test_many_connections_holding_partial_large_sets_are_bounded_node_wide(
    nodes: NodeFactory,
) -> None:
    node = nodes(vbuckets=4)
    declared = 20 * MIB
    header = encode_frame(
        Magic.REQUEST,
        Opcode.SET,
        vbucket=vbucket_for_key(b"k", 4),
        extras=STORE_EXTRAS.pack(0, 0),
        key=b"k",
        value=b"",
    )
    # Rewrite the body length to the declared 20 MiB (extras 8 + key 1 + value).
    header = header[:8] + (8 + 1 + declared).to_bytes(4, "big") + header[12:]
    chunk = b"v" * MIB
    with sockets() as opened:
        before = settle_rss(node, 0.5)
        for _ in range(200):
            sock = authenticated_socket(node)
            sock.setblocking(False)
            opened.append(sock)
            with contextlib.suppress(BlockingIOError):
                sock.send(header)
                sent = 0
                while sent < MIB:  # bounded: 1 MiB, or the node stopped reading us
                    sent += sock.send(chunk[sent:])
        grown = settle_rss(node) - before
        allowed = limits.PARTIAL_REQUEST_BYTES_MAX + 40 * MIB  # the budget + buffers in flight
        print(f"RSS grew {grown / MIB:.1f} MiB (allowed {allowed / MIB:.0f})")
    assert grown < allowed, f"RSS grew {grown / MIB:.0f} MiB (allowed {allowed / MIB:.0f})"

    async def still_serves() -> None:
        kv = await kv_connect(node)
        try:
            await kv.upsert(b"after", b"ok")
            assert (await kv.get(b"after")).value == b"ok"
        finally:
            await kv.close()

    asyncio.run(still_serves())


def test_a_value_over_the_limit_is_e2big_and_the_connection_stays(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)
    vb = vbucket_for_key(b"huge", 4)
    with sockets() as opened:
        sock = authenticated_socket(node)
        opened.append(sock)
        too_big = encode_request(
            Opcode.SET,
            opaque=77,
            vbucket=vb,
            extras=STORE_EXTRAS.pack(0, 0),
            key=b"huge",
            value=b"x" * (limits.FRAME_SIZE_MAX + 1),
        )
        sock.sendall(too_big + encode_request(Opcode.NOOP, opaque=78))
        reader = FrameReader()
        answers = []
        while len(answers) < 2:  # bounded by the socket timeout
            while (frame := reader.next_frame()) is not NEED_DATA:
                answers.append(frame)
            if len(answers) < 2:
                reader.feed(sock.recv(65536))
        assert [(a.opaque, a.status) for a in answers] == [  # type: ignore[union-attr]
            (77, Status.E2BIG),
            (78, Status.SUCCESS),
        ]


def test_a_dcp_connection_that_never_reads_holds_bounded_backfills(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=64, args=["--no-durable"])

    async def load() -> None:
        kv = await kv_connect(node)
        try:
            value = b"d" * 2000
            for start in range(0, 100_000, 1000):
                await kv.upsert_many([(b"key%07d" % n, value) for n in range(start, start + 1000)])
        finally:
            await kv.close()

    asyncio.run(load())
    node.restart()  # memory is empty: every stream from 0 must backfill from disk
    with sockets() as opened:
        sock = authenticated_socket(node)
        opened.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        before = settle_rss(node, 0.5)
        requests = [
            encode_dcp_open(DcpOpen(1, "hostile:never-reads", OpenFlag.PRODUCER)),
            encode_dcp_control(DcpControl(2, "connection_buffer_size", str(1 << 30))),
        ]
        requests += [
            encode_stream_request(StreamRequest(vb, 100 + vb, 0, 0, 2**64 - 1, 0, 0, 0))
            for vb in range(64)
        ]
        sock.sendall(b"".join(requests))  # then never read
        grown = settle_rss(node, 3.0) - before
    allowed = limits.BACKFILL_BYTES_PER_CONNECTION_MAX + limits.WRITE_BUFFER_HIGH_BYTES + 48 * MIB
    print(f"RSS grew {grown / MIB:.1f} MiB (allowed {allowed / MIB:.0f})")
    assert grown < allowed, f"RSS grew {grown / MIB:.0f} MiB (allowed {allowed / MIB:.0f})"
