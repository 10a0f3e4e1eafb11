"""Replica vbuckets over real processes: etcd plus three nodes on loopback (issue 11).

The seed's scenario (follower-catch-up.md): a replica that was down catches up on everything it
missed — from the active's memory when the gap is still there, from its disk when it is not —
and every copy of every vbucket ends equal to its active's, metadata included.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aetcd
import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import KvClient
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.kv import StoreCommand, encode_store
from changefeed.protocol.opcode import Datatype, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap
from support.clients import raw_connection, stats
from support.cluster import (
    assert_copies_equal,
    cluster_map,
    replication_stats,
    same_copy,
    start_cluster,
    wait_for_map,
    wait_persisted,
    wait_replicated,
    write_config,
)
from support.consumer import Change
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)


async def write(
    node: NodeProcess, prefix: bytes, count: int, *, avoid: int | None = None, pad: int = 0
) -> int:
    """Write `count` keys through `node` (the client routes by the map), skipping keys whose
    active is the node on port `avoid` (down: its vbuckets cannot take writes until failover,
    issue 12). Returns the keys written."""
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        assert kv.cluster_map is not None
        keys = []
        n = 0
        while len(keys) < count:
            key = prefix + b"%06d" % n
            n += 1
            active = kv.cluster_map.active(kv.vbucket_of(key))
            assert active is not None
            if active.port != avoid:
                keys.append(key)
        await kv.upsert_many([(k, b"v-" + k + b"." * pad) for k in keys])
        for key in keys[::7]:  # some updates and deletes: more than one version per key
            await kv.upsert(key, b"updated", flags=7, expiry=0)
        for key in keys[::11]:
            await kv.remove(key)
        return len(keys)


def by_name(nodes: list[NodeProcess], cmap: ClusterMap) -> dict[str, NodeProcess]:
    return {next(x.server for x in cmap.nodes if x.port == n.port): n for n in nodes}


@pytest.mark.parametrize("gap_from", ["memory", "disk"])
def test_a_replica_that_was_down_catches_up_and_rejoins_the_in_sync_set(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path, gap_from: str
) -> None:
    extra: list[str] = []
    gap, pad = 1000, 0
    if gap_from == "disk":  # a gap bigger than the tiny quota: n2's cursor on n1 is dropped
        config = write_config(tmp_path / "c.toml", checkpoint_max_bytes=2048)
        extra = ["--config", str(config), "--checkpoint-quota-bytes", str(1 << 20)]
        gap, pad = 4000, 600
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=3, replicas=2, extra=extra)
    n1, n2, _n3 = cluster
    asyncio.run(write(n1, b"a", 1000))
    asyncio.run(wait_replicated(cluster))

    n2.stop()
    asyncio.run(write(n1, b"b", gap, avoid=n2.port, pad=pad))
    before = asyncio.run(replication_stats(n1))
    backfills_before = int(asyncio.run(_general(n1))["dcp_backfills_started"])
    n2.start()
    asyncio.run(wait_replicated(cluster))
    backfills = int(asyncio.run(_general(n1))["dcp_backfills_started"]) - backfills_before

    compared = asyncio.run(assert_copies_equal(cluster))
    assert compared > 1000
    cmap = asyncio.run(cluster_map(n1))
    n2_server = f"127.0.0.1:{n2.port}"

    async def in_sync_everywhere() -> None:
        for _ in range(100):
            ok = True
            for node in cluster:
                stats = await replication_stats(node)
                flags = [v for k, v in stats.items() if ":replica:n2:in_sync" in k]
                ok = ok and all(v == "1" for v in flags)
            if ok:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("n2 did not rejoin the in-sync set")

    asyncio.run(in_sync_everywhere())
    assert any(
        n2_server in [x.server for x in cmap.replica_nodes(vb)] for vb in range(cmap.vbuckets)
    )
    after = asyncio.run(replication_stats(n1))
    assert float(after["replication_catchups_finished"]) > float(
        before["replication_catchups_finished"]
    )
    if gap_from == "disk":  # n2's cursor was dropped, or its checkpoints freed
        assert backfills > 0, "the gap should have come from disk"
    else:  # n2's cursor stayed on n1 while it was down, holding the gap in memory
        assert backfills == 0, f"{backfills} backfills: the gap should have come from memory"


async def _general(node: NodeProcess) -> dict[str, str]:
    conn = await raw_connection(node)
    try:
        return await stats(conn, "")
    finally:
        await conn.close()


def test_a_replica_killed_mid_catch_up_resumes_without_gap_or_duplicate(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "c.toml", checkpoint_max_bytes=2048)
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2, extra=["--config", str(config)]
    )
    n1, n2, _n3 = cluster
    n2.stop()
    asyncio.run(write(n1, b"c", 4000, avoid=n2.port))
    n2.start()
    asyncio.run(asyncio.sleep(0.3))  # part-way through its catch-up
    n2.kill()  # kill -9: what it received but had not persisted is gone
    n2.start()
    asyncio.run(assert_copies_equal(cluster))


async def _stats(node: NodeProcess, group: str) -> dict[str, str]:
    conn = await raw_connection(node)
    try:
        return await stats(conn, group)
    finally:
        await conn.close()


async def write_to(node: NodeProcess, prefix: bytes, count: int, *, only: int) -> list[bytes]:
    """Write `count` new keys (first versions) whose active is the node on port `only`."""
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        assert kv.cluster_map is not None
        keys: list[bytes] = []
        n = 0
        while len(keys) < count:
            key = prefix + b"%06d" % n
            n += 1
            active = kv.cluster_map.active(kv.vbucket_of(key))
            if active is not None and active.port == only:
                keys.append(key)
        await kv.upsert_many([(k, b"v-" + k) for k in keys])
        return keys


@pytest.mark.parametrize("diverged", ["new-keys", "updates"])
def test_replicas_ahead_of_a_restarted_active_roll_back_to_the_common_point_and_converge(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path, diverged: str
) -> None:
    """The active loses its tail (a disk restored from a crash-consistent snapshot, as after
    losing unsynced writes); its replicas hold writes of a branch that no longer exists. On
    reconnect they get ROLLBACK to the branch point and truncate before taking anything new:
    exactly there when the lost writes were first versions of their keys, from 0 (a rebuild)
    when they were updates, whose older versions the store no longer has."""
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=3, replicas=2)
    n1, n2, n3 = cluster
    common = asyncio.run(write_to(n1, b"common", 300, only=n1.port))
    asyncio.run(wait_replicated(cluster))
    asyncio.run(wait_persisted(n1))  # the snapshot holds the common writes
    snapshot = n1.snapshot_data(tmp_path / "n1-snapshot")  # crash-consistent, unclean
    if diverged == "new-keys":
        lost = asyncio.run(write_to(n1, b"lost", 200, only=n1.port))
    else:
        lost = []
        asyncio.run(write_to(n1, b"common", 300, only=n1.port))  # second versions
    asyncio.run(wait_replicated(cluster))
    n1.kill()
    n1.restore_data(snapshot)
    n1.start()  # unclean: a new failover branch starts at its last whole snapshot
    asyncio.run(write_to(n1, b"after", 100, only=n1.port))

    asyncio.run(assert_copies_equal(cluster))
    for replica in (n2, n3):
        feeds = asyncio.run(_stats(replica, "replica-feeds"))
        rollbacks = sum(int(v) for k, v in feeds.items() if k.endswith(":rollbacks"))
        rebuilds = sum(int(v) for k, v in feeds.items() if k.endswith(":full_rebuilds"))
        assert rollbacks > 0, feeds
        assert (rebuilds > 0) == (diverged == "updates"), feeds

    async def read_back() -> None:
        async with await KvClient.connect("127.0.0.1", n2.port) as kv:
            for key in lost[:20]:
                with pytest.raises(KeyNotFoundError):
                    await kv.get_replica(key, 1)
            for key in common[:20]:
                assert (await kv.get_replica(key, 1)).value == b"v-" + key

    asyncio.run(read_back())


def test_a_replica_that_stops_answering_leaves_the_in_sync_set_and_rejoins(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    """SIGSTOP: the replica's connection stays open but it acknowledges nothing; once it has
    not been caught up for replica_lag_max_s while writes go on, it is out (time, not count)."""
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2,
        extra=["--replica-lag-max-s", "1"],
    )  # fmt: skip
    n1, n2, _n3 = cluster
    asyncio.run(write_to(n1, b"warm", 50, only=n1.port))
    asyncio.run(wait_replicated(cluster))

    def n2_in_sync() -> list[str]:
        found = asyncio.run(replication_stats(n1))
        return [v for k, v in found.items() if ":replica:n2:in_sync" in k]

    assert n2_in_sync() and set(n2_in_sync()) == {"1"}
    os.kill(n2.pid, signal.SIGSTOP)
    try:
        for _ in range(30):  # writes keep coming; n2 acknowledges none of them
            asyncio.run(write_to(n1, b"w%03d" % _, 20, only=n1.port))
            if "1" not in n2_in_sync():
                break
            asyncio.run(asyncio.sleep(0.2))
        assert "1" not in n2_in_sync(), "a silent replica stayed in the in-sync set"
        n3_flags = [
            v for k, v in asyncio.run(replication_stats(n1)).items() if ":replica:n3:in_sync" in k
        ]
        assert set(n3_flags) == {"1"}  # the replica that keeps up stays in
    finally:
        os.kill(n2.pid, signal.SIGCONT)
    asyncio.run(wait_replicated(cluster))
    for _ in range(50):
        if set(n2_in_sync()) == {"1"}:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert set(n2_in_sync()) == {"1"}, "n2 did not rejoin after catching up"


def test_a_replica_below_the_purge_seqno_rebuilds_from_zero(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    """The range the replica needs was purged by compaction (tombstones gone): it must not
    resume across the hole (it would keep deleted keys); it rolls back to 0 and rebuilds."""
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=3, replicas=2)
    n1, n2, _n3 = cluster
    keys = asyncio.run(write_to(n1, b"p", 300, only=n1.port))
    asyncio.run(wait_replicated(cluster))
    n2.stop()

    async def delete() -> None:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            for key in keys[::2]:
                await kv.remove(key)

    async def purge() -> None:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            for vb in sorted({kv.vbucket_of(k) for k in keys}):
                summary = await kv.compact(vb, drop_deletes=True)
                assert summary.purged > 0, summary

    asyncio.run(delete())
    # n2's cursor on n1 pins the tombstones in memory (and memory is never purged): a restart
    # of n1 clears it, so the tombstones can be purged and n2 must come back from disk.
    n1.stop()
    n1.start()
    asyncio.run(purge())
    n2.start()
    asyncio.run(assert_copies_equal(cluster))
    feeds = asyncio.run(_stats(n2, "replica-feeds"))
    assert sum(int(v) for k, v in feeds.items() if k.endswith(":rollbacks")) > 0, feeds

    async def deleted_are_gone() -> None:
        async with await KvClient.connect("127.0.0.1", n2.port) as kv:
            for key in keys[:40:2]:
                with pytest.raises(KeyNotFoundError):
                    await kv.get_replica(key, 1)

    asyncio.run(deleted_are_gone())


def test_catch_up_from_disk_is_rate_limited_for_all_replicas_together(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    """Two replicas catch up from disk at once; the active's one bound holds for both (it is
    a lower bound on time, so a loaded machine cannot make this flaky)."""
    rate = 128 * 1024
    config = write_config(tmp_path / "c.toml", replication_catchup_bytes_per_s=rate)
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2, extra=["--config", str(config)]
    )
    n1, n2, n3 = cluster
    n2.stop()
    n3.stop()

    async def load() -> None:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            assert kv.cluster_map is not None
            keys = [b"r%06d" % i for i in range(4000)]
            mine = [k for k in keys if kv.cluster_map.active(kv.vbucket_of(k)).port == n1.port]
            await kv.upsert_many([(k, b"x" * 200) for k in mine])

    asyncio.run(load())
    n1.stop()  # memory (and the replicas' cursors there) gone: catch-up comes from disk
    n1.start()
    started = time.monotonic()  # the bound is checked from here: before either replica runs
    n2.start()
    n3.start()
    asyncio.run(wait_replicated(cluster, timeout_s=120))
    took = time.monotonic() - started
    sent = int(asyncio.run(_stats(n1, ""))["replication_catchup_bytes"])
    assert sent > 2 * rate, sent  # both replicas read from disk, charged to the bound
    # One second of burst is allowed; everything beyond goes at `rate`.
    assert took >= (sent - rate) / rate * 0.9, (took, sent)
    asyncio.run(assert_copies_equal(cluster))


async def publish_map(endpoint: str, cluster: str, new: ClusterMap) -> None:
    """Put a map revision in etcd as the orchestrator would (a failover or a move: issue 12
    decides those; here the test plays the orchestrator, without its fencing)."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host, int(port)) as client:
        await client.put(f"/changefeed/{cluster}/map".encode(), json.dumps(new.to_json()).encode())


def test_the_active_moves_during_catch_up_and_the_replica_follows_it(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    """n2 is catching up (slowly: rate-limited, from disk) when the map moves n1's vbuckets to
    n3. n1 ends their streams (STATE_CHANGED), n2 re-requests from n3 from where it got to,
    n1 becomes a replica of n3; every copy converges."""
    config = write_config(tmp_path / "c.toml", replication_catchup_bytes_per_s=64 * 1024)
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2, extra=["--config", str(config)]
    )
    n1, n2, _n3 = cluster
    n2.stop()
    asyncio.run(write_to(n1, b"m", 1500, only=n1.port))
    n1.stop()  # memory gone: n2's catch-up will read n1's disk, at 64 KiB/s
    n1.start()
    asyncio.run(wait_for_map(n1))
    n2.start()
    asyncio.run(asyncio.sleep(0.5))  # part-way

    async def etcd_map() -> ClusterMap:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as metadata:
            found = await metadata.read_map()
            assert found is not None
            return found[0]

    current = asyncio.run(etcd_map())
    names = [n.name for n in current.nodes]
    i1, i3 = names.index("n1"), names.index("n3")
    moved = [vb for vb, chain in enumerate(current.chains) if chain[0] == i1]
    assert moved
    chains = [
        (i3, *[i1 if i == i3 else i for i in chain[1:]]) if chain[0] == i1 else chain
        for chain in current.chains
    ]
    new = ClusterMap(current.rev + 1, current.nodes, tuple(chains), current.replicas)
    before = int(asyncio.run(_stats(n2, "replica-feeds")).get("n3:items", "0"))
    asyncio.run(publish_map(etcd.endpoint, cluster_name, new))

    asyncio.run(wait_for_map(n2, rev_at_least=new.rev))
    asyncio.run(assert_copies_equal(cluster))
    assert int(asyncio.run(_stats(n1, ""))["dcp_streams_ended_state_changed"]) >= len(moved)
    feeds = asyncio.run(_stats(n2, "replica-feeds"))
    assert set(moved) <= {int(v) for v in feeds["n3:vbuckets"].split(",")}, feeds
    assert int(feeds["n3:items"]) > before, feeds  # the rest came from the new active
    assert sum(int(v) for k, v in feeds.items() if k.endswith(":full_rebuilds")) == 0, feeds


def test_a_client_with_a_stale_map_gets_not_my_vbucket_with_the_map_and_succeeds(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=3, replicas=1)
    n1 = cluster[0]

    async def scenario() -> None:
        async with await KvClient.connect("127.0.0.1", n1.port) as kv:
            stale = kv.cluster_map
            assert stale is not None and stale.rev == 1
            # Raw: a write to a node that holds no active copy of the vbucket.
            key = b"wrong-node"
            vb = kv.vbucket_of(key)
            active = stale.active(vb)
            wrong = next(n for n in cluster if active is None or n.port != active.port)
            conn = await raw_connection(wrong)
            try:
                opaque = conn.next_opaque()
                request = encode_store(StoreCommand(Opcode.SET, vb, opaque, key, b"v"))
                response = await conn.request(request, opaque)
            finally:
                await conn.close()
            assert response.status == Status.NOT_MY_VBUCKET
            assert response.datatype & Datatype.JSON
            assert ClusterMap.from_couchbase_config(json.loads(response.value)) == stale

            # The map moves every vbucket's active to its first replica (rev 2).
            async def etcd_map() -> ClusterMap:
                async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
                    found = await md.read_map()
                    assert found is not None
                    return found[0]

            current = await etcd_map()
            swapped = tuple((c[1], c[0]) for c in current.chains)
            await publish_map(etcd.endpoint, cluster_name, ClusterMap(2, current.nodes, swapped, 1))
            for node in cluster:
                await wait_for_map(node, rev_at_least=2)
            written = await kv.upsert_many([(b"k%04d" % i, b"v") for i in range(200)])
            assert kv.retries > 0  # answered NOT_MY_VBUCKET, learnt rev 2, retried
            assert kv.cluster_map is not None and kv.cluster_map.rev == 2
            assert (await kv.get(b"k0007")).value == b"v"
            assert len(written) == 200

    asyncio.run(scenario())


def test_the_copy_comparison_can_fail() -> None:
    """`same_copy` is what every test here trusts: it must see a changed value, a changed
    cas, a missing live key and a tombstone the other side has not purged."""
    live = Change(5, b"k", False, b"v", 0, 10)
    tomb = Change(6, b"t", True, b"", 0, 11)
    truth = {b"k": live, b"t": tomb}
    assert same_copy(truth, 0, dict(truth), 0) == []
    assert same_copy(truth, 0, {b"k": live}, 6) == []  # the copy purged the tombstone
    assert same_copy(truth, 0, {b"k": live}, 5)  # ...but not that far
    assert same_copy(truth, 0, {b"t": tomb}, 99)  # a live key missing
    assert same_copy(truth, 0, {b"k": Change(5, b"k", False, b"x", 0, 10), b"t": tomb}, 0)
    assert same_copy(truth, 0, {b"k": Change(5, b"k", False, b"v", 0, 12), b"t": tomb}, 0)
