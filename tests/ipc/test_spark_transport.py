"""The Spark source's ``transport=shm``: a micro-batch's bounded read from the node's
shared-memory ring gives the rows a TCP read of the same ranges gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa

from changefeed.consumer.handshake import connect
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange, read_ranges_sync
from ipc.test_node_wiring import load, shm_node
from support.nodes import NodeFactory

Row = tuple[int, int, str, str, bytes]


async def stat(port: int, group: str) -> dict[str, str]:
    conn = await connect(
        "127.0.0.1", port, agent="test", user="Administrator", password="password", bucket="default"
    )
    try:
        opaque = conn.next_opaque()
        frames = await conn.request_many(
            encode_request(Opcode.STAT, opaque=opaque, key=group.encode()),
            opaque,
            lambda f: not f.key or f.status != Status.SUCCESS,
        )
    finally:
        await conn.close()
    return {f.key.decode(): f.value.decode() for f in frames if f.key}


def positions(port: int, vbuckets: list[int]) -> dict[int, tuple[int, int]]:
    """vbucket -> (vb_uuid, high seqno) on the node now."""
    seqnos = asyncio.run(stat(port, "vbucket-seqno"))
    return {
        vb: (int(seqnos[f"vb_{vb}:uuid"]), int(seqnos[f"vb_{vb}:high_seqno"])) for vb in vbuckets
    }


def rows_of(batches: list[pa.RecordBatch]) -> set[Row]:
    out: set[Row] = set()
    for batch in batches:
        names = ("vbucket", "seqno", "key", "op", "value")
        out |= set(zip(*(batch.column(n).to_pylist() for n in names), strict=True))
    return out


def test_transport_shm_reads_what_tcp_reads(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path)
    vbuckets = [0, 1, 2, 3, 4, 5]  # a partition across both groups (0-3, 4-7)
    tcp = SourceOptions(port=node.port)
    shm = SourceOptions(port=node.port, transport="shm", shm_dir=str(ipc_dir))
    assert SourceOptions.parse({"transport": "SHM", "shmDir": "/x"}).transport == "shm"
    asyncio.run(load(node.port, 2000))
    first = positions(node.port, vbuckets)
    ranges = [VbRange(vb, VbOffset(), first[vb][1], first[vb][0]) for vb in vbuckets]
    by_shm = list(read_ranges_sync(shm, ranges))
    assert rows_of(by_shm) == rows_of(list(read_ranges_sync(tcp, ranges)))
    assert sum(b.num_rows for b in by_shm) == len(rows_of(by_shm))  # each row once
    # The next micro-batch, from where the first ended: the ring now.
    asyncio.run(load(node.port, 600, prefix="next"))
    second = positions(node.port, vbuckets)
    ranges = [
        VbRange(
            vb,
            VbOffset(first[vb][0], first[vb][1], first[vb][1], first[vb][1]),
            second[vb][1],
            second[vb][0],
        )
        for vb in vbuckets
    ]
    by_shm = list(read_ranges_sync(shm, ranges))
    got = rows_of(by_shm)
    assert got == rows_of(list(read_ranges_sync(tcp, ranges)))
    assert all(first[vb][1] < seqno <= second[vb][1] for vb, seqno, *_ in got)
    for batch in by_shm:  # bounded: snapshots cut at the end, as over TCP
        ends = [second[vb][1] for vb in batch.column("vbucket").to_pylist()]
        assert all(s <= e for s, e in zip(batch.column("snap_end").to_pylist(), ends, strict=True))
