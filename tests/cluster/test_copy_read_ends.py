"""A `to_latest` read of a node's own copy ends when that copy's high seqno is an ABORT (a
durable write that timed out), on the active and on its replica, before and after the replica
restarts — the multi-host partition tests' hang ("vbuckets [5] not read in 60 s: ... last
seqnos {5: 16}"): a restarted copy holds the abort in no checkpoint and no disk snapshot holds
one (the store keeps SyncWrite prepares and aborts out of `by_seqno`), so the stream waited for
a seqno nothing could send."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import KvClient
from changefeed.protocol.errors import SyncWriteAmbiguousError
from support.cluster import (
    cluster_map,
    copy_of,
    seqnos,
    start_cluster,
    wait_persisted,
    wait_replicated,
)
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)


def test_a_copy_whose_high_seqno_is_an_abort_is_read_to_its_end(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=2, replicas=1)
    n1, n2 = cluster
    asyncio.run(wait_replicated(cluster))

    async def write_then_abort() -> tuple[int, bytes]:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            cmap = await cluster_map(n1)
            led = {
                vb for vb in range(cmap.vbuckets) if (a := cmap.active(vb)) and a.port == n1.port
            }
            key = next(k for i in range(10_000) if kv.vbucket_of(k := b"abort-%d" % i) in led)
            vb = kv.vbucket_of(key)
            await kv.upsert(key, b"before", durability="majority")
            os.kill(n2.pid, signal.SIGSTOP)  # its acks stop: the durable write times out
            try:
                kv.durability_timeout_ms = 500
                with pytest.raises(SyncWriteAmbiguousError):
                    await kv.upsert(key, b"never", durability="majority")
            finally:
                os.kill(n2.pid, signal.SIGCONT)
            return vb, key

    vb, key = asyncio.run(write_then_abort())

    async def read_copies() -> None:
        await wait_replicated(cluster)
        high = (await seqnos(n1))[vb][0]
        assert (await seqnos(n2))[vb][0] == high
        for node in cluster:
            copy = await copy_of(node, [vb])  # TimeoutError when the stream never ends
            assert copy[vb][key].value == b"before", node
            assert max(change.seqno for change in copy[vb].values()) < high  # the abort
        await wait_persisted(n2)

    asyncio.run(read_copies())
    n2.restart()  # its copy of vb: the abort flushed, no checkpoint holds it

    async def read_restarted() -> None:
        await wait_replicated(cluster)
        copy = await copy_of(n2, [vb])
        assert copy[vb][key].value == b"before"

    asyncio.run(read_restarted())
