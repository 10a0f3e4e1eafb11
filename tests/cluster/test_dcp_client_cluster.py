"""``DcpClient`` on a real cluster: etcd plus three nodes on loopback (issue 11, item 2).

The client bootstraps from one node, reads the map and streams every vbucket from the node that
holds its active copy. What it receives is compared with what a ``KvClient`` wrote — every
streamed item must be a write the store acknowledged (same key, value, seqno and CAS), and the
newest item per key must be the newest write — across the cases that move a stream: a stale
map (NOT_MY_VBUCKET), an active moved by a new map (STREAM_END STATE_CHANGED) and a node that
restarts (a dropped connection). The tests share one cluster and one ledger of everything
written, so each reads the whole bucket's history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata, Leadership
from changefeed.consumer import (
    DcpClient,
    Disconnected,
    KvClient,
    MutationResult,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.handshake import call
from changefeed.protocol.dcp import (
    DcpOpen,
    OpenFlag,
    StreamFlag,
    StreamRequest,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap
from support.clients import dcp_config, raw_connection, stats
from support.cluster import cluster_map, start_cluster, wait_for_map, wait_replicated
from support.consumer import StreamedState, all_ended, drain, reached
from support.nodes import node_factory

pytestmark = pytest.mark.timeout(120)
VBUCKETS = 16


@dataclass
class Ledger:
    """Every write the cluster acknowledged: (vb, seqno) -> (key, value or None, cas)."""

    by_seqno: dict[tuple[int, int], tuple[bytes, bytes | None, int]] = field(default_factory=dict)
    latest: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> (vb, seqno)

    def record(self, key: bytes, value: bytes | None, result: MutationResult) -> None:
        assert result.seqno > 0, result
        self.by_seqno[result.vbucket, result.seqno] = (key, value, result.cas)
        self.latest[key] = (result.vbucket, result.seqno)

    def highs(self) -> dict[int, int]:
        out = dict.fromkeys(range(VBUCKETS), 0)
        for vb, seqno in self.by_seqno:
            out[vb] = max(out[vb], seqno)
        return out

    async def write(self, node: NodeProcess, prefix: bytes, count: int) -> None:
        """Write ``count`` keys through ``node`` (routed by the map), update every 5th and
        delete every 7th, recording what each write answered."""
        async with await KvClient.connect(HOST, node.port) as kv:
            items = [(prefix + b"%05d" % i, b"v-%s-%d" % (prefix, i)) for i in range(count)]
            for (key, value), result in zip(items, await kv.upsert_many(items), strict=True):
                self.record(key, value, result)
            for key, _ in items[::5]:
                self.record(key, b"updated-" + key, await kv.upsert(key, b"updated-" + key))
            for key, _ in items[::7]:
                self.record(key, None, await kv.remove(key))

    def check(self, state: StreamedState, vbuckets: list[int]) -> int:
        """Every item in ``state`` is an acknowledged write, and the newest item of each key of
        ``vbuckets`` is its newest write. Returns the keys checked."""
        assert not state.refused, state.refused
        for vb in vbuckets:
            for change in state.history.get(vb, []):
                written = self.by_seqno.get((vb, change.seqno))
                assert written is not None, f"vb {vb} seqno {change.seqno} was never written"
                key, value, cas = written
                assert (change.key, change.cas) == (key, cas), (vb, change, written)
                assert change.deleted == (value is None), (vb, change, written)
                if value is not None:
                    assert change.value == value, (vb, change, written)
        newest = {
            key: seqno
            for vb in vbuckets
            for key, seqno in ((c.key, c.seqno) for c in state.history.get(vb, []))
        }
        wanted = {k: s for k, (vb, s) in self.latest.items() if vb in vbuckets}
        assert newest == wanted
        return len(wanted)


@pytest.fixture(scope="module")
def cluster(
    etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[NodeProcess]]:
    with node_factory(tmp_path_factory.mktemp("dcp-cluster")) as nodes:
        yield start_cluster(
            nodes, etcd.endpoint, "dcpclient", count=3, replicas=1, vbuckets=VBUCKETS
        )


@pytest.fixture(scope="module")
def ledger(cluster: list[NodeProcess]) -> Ledger:
    written = Ledger()
    asyncio.run(written.write(cluster[0], b"base", 1500))
    return written


def test_a_client_bootstrapped_from_one_node_streams_each_vbucket_from_its_active(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    n1 = cluster[0]
    vbs = list(range(VBUCKETS))

    async def body() -> None:
        cmap = await cluster_map(n1)
        async with DcpClient(dcp_config(n1, to_latest=False)) as client:
            await client.stream(vbs)
            state = StreamedState()
            await drain(client, state, reached(ledger.highs()))
            # Each node streams exactly the vbuckets it holds active, on one connection.
            for node in cluster:
                conn = await raw_connection(node)
                try:
                    found = await stats(conn, "dcp")
                finally:
                    await conn.close()
                mine = [vb for vb in vbs if active_port(cmap, vb) == node.port]
                assert mine, "every node is active for some vbuckets"
                assert found.get(f"{client.config.name}:streams") == str(len(mine)), found
        assert ledger.check(state, vbs) > 1000
        assert state.disconnects == 0 and not state.rollbacks

    asyncio.run(body())


def test_a_client_bootstrapped_at_a_node_active_for_none_of_its_vbuckets(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    n3 = cluster[2]

    async def body() -> None:
        cmap = await cluster_map(n3)
        vbs = [vb for vb in range(VBUCKETS) if active_port(cmap, vb) != n3.port]
        assert vbs and len(vbs) < VBUCKETS
        state = StreamedState()
        async with DcpClient(dcp_config(n3)) as client:  # to the latest seqno
            await client.stream(vbs)
            await drain(client, state, all_ended(vbs))
        assert ledger.check(state, vbs) > 500
        assert all(reason == 0 for reason in state.ended.values()), state.ended

    asyncio.run(body())


def test_a_client_not_following_the_map_reads_one_nodes_replica_copies(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    """``follow_map=False`` (how tests read a copy): a replica holder's own copy is streamed."""
    n1 = cluster[0]

    async def body() -> None:
        await wait_replicated(cluster)
        cmap = await cluster_map(n1)
        vbs = [vb for vb in range(VBUCKETS) if n1.port in {n.port for n in cmap.replica_nodes(vb)}]
        assert vbs
        state = StreamedState()
        async with DcpClient(dcp_config(n1, follow_map=False)) as client:
            await client.stream(vbs)
            await drain(client, state, all_ended(vbs))
            assert client.cluster_map is None
        assert ledger.check(state, vbs) > 100

    asyncio.run(body())


def test_a_vbucket_no_node_serves_is_refused_after_the_retries(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    async def body() -> None:
        config = dcp_config(cluster[0], reconnect_backoff_s=(0.01,))
        async with DcpClient(config) as client:
            await client.stream([VBUCKETS + 3, 1])
            refused: list[StreamRefused] = []
            ended: list[StreamEnded] = []  # vb 1, to the latest seqno: the good one unharmed
            async with asyncio.timeout(30):
                async for event in client.events():
                    if isinstance(event, StreamRefused):
                        refused.append(event)
                    elif isinstance(event, StreamEnded):
                        ended.append(event)
                    assert not isinstance(event, Disconnected), event
                    if refused and ended:
                        break
        assert [e.vbucket for e in ended] == [1]
        assert [(e.vbucket, e.status) for e in refused] == [(VBUCKETS + 3, Status.NOT_MY_VBUCKET)]

    asyncio.run(body())


def test_a_stream_request_to_a_replica_holder_gets_not_my_vbucket_with_the_map(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    async def body() -> None:
        cmap = await cluster_map(cluster[0])
        vb = 0
        replica = cmap.replica_nodes(vb)[0]
        holder = next(n for n in cluster if n.port == replica.port)
        conn = await raw_connection(holder)
        try:
            opaque = conn.next_opaque()
            open_request = DcpOpen(opaque, "raw-replica-probe", OpenFlag.PRODUCER)
            assert (await conn.request(encode_dcp_open(open_request), opaque)).status == 0
            opaque = conn.next_opaque()
            request = StreamRequest(vb, opaque, StreamFlag.ACTIVE_VB_ONLY, 0, 2**64 - 1, 0, 0, 0)
            answer = await conn.request(encode_stream_request(request), opaque)
            config = json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
        finally:
            await conn.close()
        assert answer.status == Status.NOT_MY_VBUCKET
        body_map = ClusterMap.from_couchbase_config(json.loads(answer.value))
        assert body_map == ClusterMap.from_couchbase_config(config)
        assert body_map.active(vb) != replica

    asyncio.run(body())


def test_streams_follow_an_active_moved_by_a_new_map(
    cluster: list[NodeProcess], ledger: Ledger, etcd: EtcdServer
) -> None:
    """Half the vbuckets' actives swap with their replica while a client follows them (their
    streams end STATE_CHANGED and resume on the new active), and a client that read the map
    before the change streams after it (NOT_MY_VBUCKET, then the new map)."""
    n1, n2, _ = cluster
    vbs = list(range(VBUCKETS))
    moved = vbs[::2]

    async def body() -> None:
        await ledger.write(n2, b"before-move", 300)
        await wait_replicated(cluster)  # a replica behind its active would mean a rollback
        async with (
            DcpClient(dcp_config(n1, to_latest=False)) as following,
            DcpClient(dcp_config(n2, to_latest=False)) as stale,
        ):
            await following.stream(vbs)
            followed = StreamedState()
            await drain(following, followed, reached(ledger.highs()))
            old = await cluster_map(n1)

            new = await swap_actives(etcd.endpoint, "dcpclient", moved)
            for node in cluster:
                await wait_for_map(node, rev_at_least=new.rev)
            await ledger.write(n1, b"after-move", 600)

            await stale.stream(vbs)
            late = StreamedState()
            taken: list[object] = []
            for client, state in ((following, followed), (stale, late)):
                await drain(client, state, reached(ledger.highs()), per_event=taken.append)
                assert ledger.check(state, vbs) > 1500
                assert not state.rollbacks and not state.ended, (state.rollbacks, state.ended)
                assert client.cluster_map is not None and client.cluster_map.rev == new.rev
            assert not any(isinstance(e, StreamEnded) for e in taken)
            reopened = [e.vbucket for e in taken if isinstance(e, StreamOpened)]
            assert sorted(reopened) == sorted(moved + vbs)  # moved ones once more
            current = await cluster_map(n1)
            for vb in moved:
                assert current.active(vb) != old.active(vb)

    asyncio.run(body())


def test_a_restarted_node_is_reconnected_and_only_its_vbuckets_resume(
    cluster: list[NodeProcess], ledger: Ledger
) -> None:
    n1, n2, _ = cluster
    vbs = list(range(VBUCKETS))

    async def body() -> None:
        cmap = await cluster_map(n1)
        on_n2 = {vb for vb in vbs if active_port(cmap, vb) == n2.port}
        assert on_n2
        async with DcpClient(dcp_config(n1, to_latest=False)) as client:
            await client.stream(vbs)
            state = StreamedState()
            taken: list[object] = []
            await drain(client, state, reached(ledger.highs()), per_event=taken.append)
            taken.clear()
            # In threads: the client runs meanwhile, retrying n2 while it is down.
            await asyncio.to_thread(n2.stop)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(n2.start)
            await wait_for_map(n2, rev_at_least=cmap.rev)
            await ledger.write(n1, b"after-restart", 400)
            await drain(client, state, reached(ledger.highs()), per_event=taken.append)
            assert state.disconnects == 1
            reopened = {e.vbucket for e in taken if isinstance(e, StreamOpened)}
            assert reopened == on_n2
        assert ledger.check(state, vbs) > 1500

    asyncio.run(body())


def active_port(cmap: ClusterMap, vb: int) -> int:
    active = cmap.active(vb)
    assert active is not None, f"vb {vb} has no active in map rev {cmap.rev}"
    return active.port


async def swap_actives(endpoint: str, cluster: str, vbuckets: list[int]) -> ClusterMap:
    """Write the next map with the active and first replica of ``vbuckets`` swapped, fenced
    by the current orchestrator's token (a rebalance step, as issue 12's will be)."""
    async with await ClusterMetadata.connect(endpoint, cluster) as metadata:
        stored = await metadata.read_map()
        leader = await metadata.leader()
        assert stored is not None and leader is not None
        current, revision = stored
        chains = list(current.chains)
        for vb in vbuckets:
            active, replica, *rest = chains[vb]
            chains[vb] = (replica, active, *rest)
        new = dataclasses.replace(current, rev=current.rev + 1, chains=tuple(chains))
        term = Leadership(metadata, leader[0], leader[1], _HeldLease())  # type: ignore[arg-type]
        assert await metadata.write_map(new, revision, term) is not None
        return new


class _HeldLease:
    """Stands for the orchestrator's lease: the write is fenced by its token in etcd."""

    lost = asyncio.Event()
    lease_id = 0
    reason = ""
