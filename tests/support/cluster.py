"""A cluster of node processes on loopback for the replication tests: etcd (``support.etcd``)
plus nodes started through the one launcher, and the checks that compare their copies.

``start_cluster`` starts ``count`` nodes named n1..nN joined to one etcd cluster and waits
until each has applied the first map. ``copy_of`` reads one node's copy of some vbuckets (its
active or replica vbuckets: DCP streams from either) as key -> newest change with all its
metadata; ``assert_copies_equal`` checks every copy of every vbucket against its active.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from pathlib import Path

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import DcpClient
from changefeed.consumer.handshake import call
from changefeed.protocol.opcode import Opcode
from changefeed.vbmap import ClusterMap
from support.clients import dcp_config, raw_connection, stats
from support.consumer import Change, StreamedState, all_ended, drain
from support.nodes import NodeFactory

MAP_WAIT_S = 30.0


def cluster_args(
    endpoint: str, cluster: str, name: str, *, count: int, replicas: int, extra: Iterable[str] = ()
) -> list[str]:
    return [
        "--etcd", endpoint, "--cluster", cluster, "--node-name", name,
        "--replicas", str(replicas), "--expected-nodes", str(count), *extra,
    ]  # fmt: skip


def start_cluster(
    nodes: NodeFactory,
    endpoint: str,
    cluster: str,
    *,
    count: int = 3,
    replicas: int = 2,
    vbuckets: int = 8,
    extra: Iterable[str] = (),
    failover_timeout_s: int = 3600,
    crash_failover: bool | None = None,
) -> list[NodeProcess]:
    """Start n1..n<count> (all at once: the first map waits for `count` of them) and wait
    until each serves a map placing every vbucket. Automatic failover is off unless a test
    asks for it (`failover_timeout_s`; `crash_failover` follows it unless given): a node
    stopped on purpose keeps its vbuckets."""
    if crash_failover is None:
        crash_failover = failover_timeout_s < 3600
    extra = [
        *extra,
        "--failover-timeout-s",
        str(failover_timeout_s),
        "--crash-failover" if crash_failover else "--no-crash-failover",
    ]
    started = [
        nodes(
            start=False,
            name=f"n{i}",
            vbuckets=vbuckets,
            args=cluster_args(
                endpoint, cluster, f"n{i}", count=count, replicas=replicas, extra=extra
            ),
        )
        for i in range(1, count + 1)
    ]
    for node in started:
        node.start()
    for node in started:
        asyncio.run(wait_for_map(node))
    return started


async def cluster_map(node: NodeProcess) -> ClusterMap:
    """The map `node` serves (GET_CLUSTER_CONFIG); node names are ``host:port`` there."""
    conn = await raw_connection(node)
    try:
        return ClusterMap.from_couchbase_config(
            json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
        )
    finally:
        await conn.close()


async def wait_for_map(node: NodeProcess, *, rev_at_least: int = 1) -> ClusterMap:
    deadline = time.monotonic() + MAP_WAIT_S
    while True:  # bounded by MAP_WAIT_S
        found = await cluster_map(node)
        if found.rev >= rev_at_least and found.replicas >= 0 and len(found.nodes) > 1:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.root.name} serves no cluster map after {MAP_WAIT_S} s")
        await asyncio.sleep(0.1)


def node_at(nodes: list[NodeProcess], server: str) -> NodeProcess:
    return next(n for n in nodes if f"{HOST}:{n.port}" == server)


async def copy_of(node: NodeProcess, vbuckets: list[int]) -> dict[int, dict[bytes, Change]]:
    """`node`'s copy of `vbuckets` (active or replica): per vb, key -> newest change."""
    state = StreamedState()
    # follow_map=False: this node's copy, not the active's (the client follows the map else).
    async with DcpClient(dcp_config(node, follow_map=False)) as client:
        await client.stream(vbuckets)
        await drain(client, state, all_ended(vbuckets), timeout_s=60.0)
    out: dict[int, dict[bytes, Change]] = {}
    for vb in vbuckets:
        latest: dict[bytes, Change] = {}
        for change in state.history.get(vb, []):
            latest[change.key] = change
        out[vb] = latest
    return out


async def seqnos(node: NodeProcess) -> dict[int, tuple[int, int]]:
    """vb -> (high seqno, persisted seqno) of every vbucket the node holds a copy of."""
    conn = await raw_connection(node)
    try:
        found = await stats(conn, "vbucket-seqno")
    finally:
        await conn.close()
    out: dict[int, tuple[int, int]] = {}
    for key, value in found.items():
        if key.endswith(":high_seqno"):
            vb = int(key[3:].split(":")[0])
            out[vb] = (int(value), int(found[f"vb_{vb}:last_persisted_seqno"]))
    return out


async def replication_stats(node: NodeProcess) -> dict[str, str]:
    conn = await raw_connection(node)
    try:
        return await stats(conn, "replication")
    finally:
        await conn.close()


async def wait_replicated(nodes: list[NodeProcess], *, timeout_s: float = 60.0) -> ClusterMap:
    """Wait until every replica copy's high seqno equals its active's."""
    cmap = await cluster_map(nodes[0])
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        highs = {n.port: await seqnos(n) for n in nodes if n.alive}
        behind = []
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            assert active is not None, vb
            want = highs[active.port][vb][0]
            for replica in cmap.replica_nodes(vb):
                got = highs.get(replica.port, {}).get(vb, (-1, -1))[0]
                if got != want:
                    behind.append((vb, replica.server, got, want))
        if not behind:
            return cmap
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas behind after {timeout_s} s: {behind[:8]}")
        await asyncio.sleep(0.1)


async def wait_persisted(node: NodeProcess, *, timeout_s: float = 60.0) -> None:
    """Wait until every vbucket copy on `node` has persisted its high seqno (a flush round
    may wait a few milliseconds to gather a group commit)."""
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        behind = [(vb, s) for vb, s in (await seqnos(node)).items() if s[1] < s[0]]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node} not persisted after {timeout_s} s: {behind[:8]}")
        await asyncio.sleep(0.02)


async def purge_seqnos(node: NodeProcess) -> dict[int, int]:
    conn = await raw_connection(node)
    try:
        found = await stats(conn, "vbucket-seqno")
    finally:
        await conn.close()
    return {
        int(key[3:].split(":")[0]): int(value)
        for key, value in found.items()
        if key.endswith(":purge_seqno")
    }


def same_copy(
    truth: dict[bytes, Change], truth_purged: int, copy: dict[bytes, Change], copy_purged: int
) -> list[str]:
    """Differences between two copies of one vbucket: every key's newest change must be equal
    (seqno, value, cas, rev_seqno, flags, expiry, datatype, deletedness), except that a
    tombstone one side still holds may be missing on the other if that side has purged up to
    its seqno (compaction runs on each copy on its own)."""
    problems = []
    for key in sorted(set(truth) | set(copy)):
        a, b = truth.get(key), copy.get(key)
        if a == b:
            continue
        if a is None and b is not None and b.deleted and b.seqno <= truth_purged:
            continue
        if b is None and a is not None and a.deleted and a.seqno <= copy_purged:
            continue
        problems.append(f"{key!r}: active {a} / copy {b}")
    return problems


async def assert_copies_equal(nodes: list[NodeProcess]) -> int:
    """Every replica copy of every vbucket equals its active's: per key the newest change's
    seqno, value, cas, rev_seqno, flags, expiry, datatype and deletedness (`same_copy`), and the
    high seqnos are equal. Returns the keys compared."""
    cmap = await wait_replicated(nodes)
    by_port = {n.port: n for n in nodes}
    purged = {n.port: await purge_seqnos(n) for n in nodes if n.alive}
    compared = 0
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        assert active is not None
        truth = (await copy_of(by_port[active.port], [vb]))[vb]
        for replica in cmap.replica_nodes(vb):
            copy = (await copy_of(by_port[replica.port], [vb]))[vb]
            problems = same_copy(truth, purged[active.port][vb], copy, purged[replica.port][vb])
            assert not problems, (
                f"vb {vb}: {replica.server} differs from {active.server} in "
                f"{len(problems)} keys: {problems[:3]}"
            )
        compared += len(truth)
    return compared


def write_config(path: Path, **values: object) -> Path:
    """A TOML config file with `values` (for settings without a flag)."""
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


async def wait_in_sync_published(endpoint: str, cluster: str, *, timeout_s: float = 30.0) -> None:
    """Wait until every vbucket's active has published an in-sync set holding all its
    replicas: before that, a failover is (rightly) refused, so a test that kills an active
    waits for this first."""
    from changefeed.cluster.metadata import ClusterMetadata

    deadline = time.monotonic() + timeout_s
    async with await ClusterMetadata.connect(endpoint, cluster) as metadata:
        while True:  # bounded by timeout_s
            missing = await metadata.vbuckets_not_fully_in_sync()
            assert missing is not None, "no map yet"
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-sync sets not published for vbuckets {missing[:8]}")
            await asyncio.sleep(0.1)


async def fail_over_by_request(
    endpoint: str, cluster: str, name: str, *, timeout_s: float = 30.0
) -> ClusterMap:
    """Ask the orchestrator to fail `name` over (`cluster failover`'s request) and wait until
    it answered (it clears the request once a step finds nothing more to change); the map
    then."""
    from changefeed.cluster.metadata import ClusterMetadata

    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        await md.request_failover(name)
        deadline = time.monotonic() + timeout_s
        while await md.failover_requests():
            assert time.monotonic() < deadline, f"the failover of {name} was never answered"
            await asyncio.sleep(0.05)
        stored = await md.read_map()
        assert stored is not None
        return stored[0]
