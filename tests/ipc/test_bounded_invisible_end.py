"""A bounded read from shared memory (`read_bounded`, the Spark source's ``transport=shm``)
ends when a vbucket's planned end seqno is a SyncWrite ABORT, which no application reader ever
gets: a micro-batch plans at the high seqnos (STAT vbucket-seqno), and a durable write that timed
out leaves an abort there. Before the fix the read waited for a row at that seqno forever (the
ring's positions only move with published rows, and the catch-up over DCP stopped at the ring's
positions)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pyarrow as pa
import pytest

from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import KvClient
from changefeed.consumer.session import SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.ipc.local_stream import read_bounded
from changefeed.protocol.errors import SyncWriteAmbiguousError
from support.clients import dcp_config
from support.cluster import cluster_map, seqnos, start_cluster, wait_replicated
from support.etcd import cluster_name, etcd
from support.nodes import NodeFactory

__all__ = ["cluster_name", "etcd"]  # the cluster tests' fixtures, used here too
pytestmark = pytest.mark.timeout(180)
READ_TIMEOUT_S = 60.0  # the read fails with TimeoutError rather than hang the suite


def test_a_bounded_read_ends_at_an_abort(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, ipc_dir: Path
) -> None:
    shm = ["--shm", "1", "--shm-dir", str(ipc_dir)]
    n1, n2 = cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=2, replicas=1, extra=shm
    )
    asyncio.run(wait_replicated(cluster))

    async def write_then_abort() -> tuple[int, list[bytes]]:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            cmap = await cluster_map(n1)
            led = {
                vb for vb in range(cmap.vbuckets) if (a := cmap.active(vb)) and a.port == n1.port
            }
            vb = min(led)
            keys = [k for i in range(20_000) if kv.vbucket_of(k := b"ab-%d" % i) == vb][:5]
            for key in keys:
                await kv.upsert(key, b"before")
            os.kill(n2.pid, signal.SIGSTOP)  # its acks stop: the durable write times out
            try:
                kv.durability_timeout_ms = 500
                with pytest.raises(SyncWriteAmbiguousError):
                    await kv.upsert(keys[0], b"never", durability="majority")
            finally:
                os.kill(n2.pid, signal.SIGCONT)
            return vb, keys

    vb, keys = asyncio.run(write_then_abort())

    async def read(start: SessionState, end: int) -> list[pa.RecordBatch]:
        config = dcp_config(n1, follow_map=False)

        async def collect() -> list[pa.RecordBatch]:
            return [b async for b in read_bounded(config, start, {vb: end}, directory=ipc_dir)]

        return await asyncio.wait_for(collect(), READ_TIMEOUT_S)

    high = asyncio.run(seqnos(n1))[vb][0]
    whole = asyncio.run(read(SessionState(), high))  # over DCP first, then the ring
    rows = [(s, k, v) for b in whole for s, k, v in zip(*_columns(b), strict=True)]
    assert sorted(k for _, k, _ in rows) == sorted(key.decode() for key in keys)
    assert {v for _, _, v in rows} == {b"before"}
    assert max(s for s, _, _ in rows) < high  # the abort is the end, no row at it
    # From the last row on: only the abort lies between, nothing is read.
    last = max(s for s, _, _ in rows)
    uuid = int(asyncio.run(_vb_uuid(n1.port, vb)))
    log = FailoverLog([(uuid, 0)])
    start = SessionState({vb: VbSession(vb, last, last, last, failover_log=log)})
    assert sum(b.num_rows for b in asyncio.run(read(start, high))) == 0


def _columns(batch: pa.RecordBatch) -> tuple[list[int], list[str], list[bytes]]:
    return (
        batch.column("seqno").to_pylist(),
        batch.column("key").to_pylist(),
        batch.column("value").to_pylist(),
    )


async def _vb_uuid(port: int, vb: int) -> str:
    from ipc.test_spark_transport import stat

    return (await stat(port, "vbucket-seqno"))[f"vb_{vb}:uuid"]
