"""The ``changefeed`` source and the mirror on a real cluster: etcd plus three nodes on
loopback, one replica per vbucket, actives spread over the nodes.

- the planner asks each vbucket's active node (its high seqno and vb_uuid equal the active's
  own), bootstraps from any seed that answers, and names a node that is down but still
  active in the map once ``nodeTimeoutS`` has passed;
- a batch read (``spark.read.format("changefeed")``) equals the store on every column (key,
  value, cas, rev_seqno, flags, expiry, op, seqno, vbucket), the store being read from every
  vbucket's active;
- a streaming mirror keeps running while a node is killed with SIGKILL and failed over by the
  orchestrator, and ends with mirror == store on every column, without restarting the query.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import KvClient
from changefeed.consumer.handshake import call
from changefeed.protocol.dcp import decode_failover_log
from changefeed.protocol.errors import KeyNotFoundError, StatusError
from changefeed.protocol.opcode import Opcode
from changefeed.spark import MirrorWriter, read_mirror
from changefeed.spark.cluster import SeedsUnreachableError
from changefeed.spark.node_state import NodeUnavailableError, fetch_latest_sync
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange, branch_point, read_ranges
from changefeed.spark.schema import ARROW_SCHEMA
from changefeed.vbmap import ClusterMap
from support.clients import raw_connection, upsert_retrying
from support.cluster import (
    cluster_map,
    seqnos,
    start_cluster,
    wait_in_sync_published,
    wait_replicated,
)
from support.etcd import cluster_name, etcd
from support.nodes import NodeFactory

from . import test_mirror as mirror_rows  # hand-built change rows (VBUCKETS = 16 as here)
from . import test_mirror_cli as cli  # the command line and documents of the CLI test
from .helpers import (
    Model,
    assert_typed_mirror_matches,
    changelog,
    diff,
    store_state,
    table_state,
    workload,
    write,
    write_meta,
)

__all__ = ["cluster_name", "etcd"]  # fixtures of the cluster tests, used here too

pytestmark = pytest.mark.timeout(300)
VBUCKETS = 16
FAST_NODE = ["--no-durable"]  # processes are killed, the machine is not
FAILOVER_TIMEOUT_S = 2  # seconds of lease: kill to promotion
CONVERGE_S = 60.0


def seeds(*members: NodeProcess) -> str:
    return ",".join(node.address for node in members)


def actives_by_port(cmap: ClusterMap) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        assert active is not None, vb
        out.setdefault(active.port, []).append(vb)
    return out


async def failover_uuid(node: NodeProcess, vb: int) -> int:
    conn = await raw_connection(node)
    try:
        return decode_failover_log((await call(conn, Opcode.GET_FAILOVER_LOG, vbucket=vb)).value)[
            0
        ][0]
    finally:
        await conn.close()


def test_branch_point_is_where_a_newer_history_left_the_planned_one() -> None:
    log = [(30, 500), (20, 120), (10, 0)]  # newest first
    assert branch_point(log, 30) is None, "the planned history is the newest"
    assert branch_point(log, 20) == 500, "one newer branch, from seqno 500"
    assert branch_point(log, 10) == 120, "the oldest newer branch starts at 120"
    assert branch_point(log, 99) is None, "a history the log does not know: no opinion"
    assert branch_point(log, 0) is None, "nothing planned"


def test_a_range_planned_on_a_history_that_branched_since_ends_at_the_branch(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    """The micro-batch was planned on one history (the active the planner asked); its stream
    opens on a history that branched off it below the planned end (here a node restored from
    an older copy; on a cluster, a failover to a replica that missed the last writes). The
    range ends at the branch point instead of waiting for seqnos the new history never
    writes, and holds exactly the shared history; the next micro-batch's rollback voids the
    rest (``test_pipeline``)."""
    node = nodes(args=FAST_NODE)
    write(node.port, [(f"k-{i:04d}", b"W0-%d" % i) for i in range(400)])
    shared = store_state(node)
    node.stop()
    old = node.copy_data(tmp_path / "old")
    node.start()
    write(node.port, [(f"k-{i:04d}", b"W1-%d" % i) for i in range(0, 400, 3)])
    options = SourceOptions.parse(node.source_options(format="binary"))
    planned, _ = fetch_latest_sync(options)
    node.stop()
    node.restore_data(old)
    node.start()  # a new history branch at the old copy's high seqnos

    async def read_all() -> list[Any]:
        ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in planned.items()]
        return [batch async for batch in read_ranges(options, ranges)]

    batches = asyncio.run(asyncio.wait_for(read_all(), 30))
    rows = pa.Table.from_batches(batches, ARROW_SCHEMA)
    assert set(pc.unique(rows.column("op")).to_pylist()) <= {"mutation"}, "no rollback: from 0"
    assert table_state(rows) == shared, "the shared history, every column, nothing past it"


def test_the_mirrors_re_read_skips_a_dead_first_seed(tmp_path: Path, nodes: NodeFactory) -> None:
    node = nodes(args=FAST_NODE)
    keys = [k for k in (f"z-{i:04d}" for i in range(400)) if mirror_rows.vb(k) == 7][:20]
    write(node.port, [(k, b"node-" + k.encode()) for k in keys[:10]])
    options = {"cluster": f"127.0.0.1:1,{node.address}", "format": "binary"}
    writer = MirrorWriter(tmp_path, options)
    rows = [mirror_rows.change(i + 1, k, b"mirror-" + k.encode()) for i, k in enumerate(keys)]
    writer.write(mirror_rows.batch(*rows), 0)
    writer.write(mirror_rows.batch(mirror_rows.rollback(7, 0)), 1)  # re-reads every key
    assert table_state(read_mirror(tmp_path)) == {
        k: d for k, d in store_state(node).items() if d.vbucket == 7
    }


def test_cluster_option_lists_seed_nodes() -> None:
    options = SourceOptions.parse({"cluster": "couchbase://a:1, b:2,a:1,c:3", "nodeTimeoutS": "4"})
    assert options.seed_nodes == (("a", 1), ("b", 2), ("c", 3))
    assert (options.host, options.port) == ("a", 1)
    assert options.node_timeout_s == 4.0
    assert SourceOptions(host="h", port=7).seed_nodes == (("h", 7),)
    for bad in ("a:1,", "a:1,b", "a:1,b:0"):
        with pytest.raises(ValueError, match="option cluster"):
            SourceOptions.parse({"cluster": bad})
    with pytest.raises(ValueError, match="option nodetimeouts"):
        SourceOptions.parse({"nodeTimeoutS": "0"})


def test_planner_asks_each_active_and_names_a_dead_one(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, rng: random.Random
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, vbuckets=VBUCKETS,
        extra=FAST_NODE,
    )  # fmt: skip
    n1, n2, n3 = cluster
    write(n1.port, workload(rng, 3000, keys=1500))
    cmap = asyncio.run(wait_replicated(cluster))
    spread = actives_by_port(cmap)
    assert len(spread) == 3, f"actives on every node: {spread}"
    # A dead seed first: the planner bootstraps from the next one.
    options = SourceOptions.parse({"cluster": f"127.0.0.1:1,{seeds(n2, n1, n3)}"})
    latest, total = fetch_latest_sync(options)
    assert total == VBUCKETS
    assert sorted(latest) == list(range(VBUCKETS))
    for port, vbs in spread.items():
        node = next(n for n in cluster if n.port == port)
        highs = asyncio.run(seqnos(node))
        for vb in vbs:
            assert latest[vb].seqno == highs[vb][0], (vb, latest[vb], highs[vb])
            assert latest[vb].vb_uuid == asyncio.run(failover_uuid(node, vb)), vb
    with pytest.raises(SeedsUnreachableError, match=r"127\.0\.0\.1:1\b"):
        fetch_latest_sync(SourceOptions.parse({"cluster": "127.0.0.1:1,127.0.0.1:2"}))

    # Killed, and automatic failover is off: n3 stays the active of its vbuckets in the map.
    n3.kill()
    started = time.monotonic()
    options = SourceOptions.parse({"cluster": seeds(n1, n2), "nodeTimeoutS": "2"})
    with pytest.raises(NodeUnavailableError) as raised:
        fetch_latest_sync(options)
    waited = time.monotonic() - started
    print(f"error after {waited:.2f} s: {raised.value}")
    assert n3.address in str(raised.value), "the error names the node"
    assert 1.5 <= waited < 10, waited
    subset = SourceOptions.parse({"cluster": seeds(n1), "vbuckets": str(spread[n1.port][0])})
    assert list(fetch_latest_sync(subset)[0]) == [spread[n1.port][0]], "others still plan"


def test_planning_during_a_failover_waits_for_the_new_active(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, rng: random.Random
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, vbuckets=VBUCKETS,
        extra=FAST_NODE, failover_timeout_s=FAILOVER_TIMEOUT_S,
    )  # fmt: skip
    n1, n2, n3 = cluster
    write(n1.port, workload(rng, 2000, keys=1000))
    asyncio.run(wait_replicated(cluster))
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))  # else failover is refused
    n3_vbs = actives_by_port(asyncio.run(cluster_map(n1)))[n3.port]
    n3.kill()
    started = time.monotonic()
    latest, _ = fetch_latest_sync(SourceOptions.parse({"cluster": seeds(n3, n1, n2)}))
    print(f"planned {time.monotonic() - started:.2f} s after the kill")
    moved = asyncio.run(cluster_map(n1))
    for vb in n3_vbs:
        active = moved.active(vb)
        assert active is not None and active.port != n3.port, (vb, active)
        node = next(n for n in cluster if n.port == active.port)
        assert latest[vb].seqno == asyncio.run(seqnos(node))[vb][0], vb
        assert latest[vb].vb_uuid == asyncio.run(failover_uuid(node, vb)), "the new branch"


def test_batch_read_of_a_cluster_equals_the_store(
    spark: Any, nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, rng: random.Random
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, vbuckets=VBUCKETS,
        extra=FAST_NODE,
    )  # fmt: skip
    n1, n2, n3 = cluster
    model: Model = {}
    meta = [(f"m-{i:04d}", f"M-{i}".encode(), i * 7, 3600 if i % 3 else 0) for i in range(600)]
    write_meta(n2.port, meta, model)
    write(n1.port, workload(rng, 6000, keys=2500, delete_ratio=0.15), model)
    cmap = asyncio.run(cluster_map(n1))
    assert len(actives_by_port(cmap)) == 3, "actives on every node"

    options = {"cluster": seeds(n3, n1, n2), "format": "binary"}
    rows = spark.read.format("changefeed").options(**options).load().toArrow()
    assert set(pc.unique(rows.column("op")).to_pylist()) == {"mutation"}, "live keys only"
    got = table_state(rows)  # key, vbucket, seqno, value, cas, flags, expiry, rev_seqno
    truth = store_state(n1)  # a DcpClient following the map: every vbucket from its active
    problem = diff(got, truth)
    assert not problem, f"batch read differs from the store: {problem}"
    assert not diff({k: d.value for k, d in truth.items()}, {k: v for k, v in model.items() if v})
    print(f"{len(got)} keys read, actives per node {actives_by_port(cmap)}")


def test_mirror_command_reads_a_cluster(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path, rng: random.Random
) -> None:
    """``changefeed mirror --cluster h1:p1,h2:p2,h3:p3 --once`` mirrors the whole cluster
    (typed documents, every column equal to the store); ``mirror status`` skips a dead seed;
    a malformed list is a usage error naming the option."""
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, vbuckets=VBUCKETS,
        extra=FAST_NODE,
    )  # fmt: skip
    n1, n2, n3 = cluster
    write(n1.port, [(f"o{i:05d}", cli.document(i, rng)) for i in range(2000)])
    write(n1.port, [(f"o{rng.randrange(2000):05d}", None) for _ in range(100)])
    tables = tmp_path / "tables"
    done = subprocess.run(
        [*cli.CHANGEFEED, "mirror", "--cluster", seeds(n2, n1, n3), "--tables", str(tables),
         "--once", "--json", "--max-offsets-per-trigger", "1500"],
        capture_output=True, timeout=cli.RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    batches = [json.loads(line) for line in done.stdout.splitlines()]
    assert batches and batches[-1]["lag"]["items"] == 0, batches
    assert_typed_mirror_matches(tables, n1)  # the store read from every vbucket's active
    status = subprocess.run(
        [*cli.CHANGEFEED, "mirror", "status", "--cluster", f"127.0.0.1:1,{n3.address}",
         "--tables", str(tables), "--json"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr.decode()[-3000:]
    lag = json.loads(status.stdout)["lag"]
    assert lag["items"] == 0 and lag["vbuckets"] == {}, lag
    bad = subprocess.run(
        [*cli.CHANGEFEED, "mirror", "--cluster", f"{n1.address},nowhere", "--tables",
         str(tables)],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2, bad
    assert b"option cluster" in bad.stderr, bad.stderr


class Writer:
    """Writes (upserts and deletes over a key range) through a ``KvClient`` that follows the
    map, until stopped; errors while a node is down are retried (the store, not this model,
    is the truth: writes an active acknowledged and did not replicate are lost on failover)."""

    def __init__(self, port: int, rng: random.Random) -> None:
        self.port = port
        self.rng = random.Random(rng.random())
        self.stop = threading.Event()
        self.batches = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        while not self.stop.is_set():
            try:
                async with await KvClient.connect(HOST, self.port) as kv:
                    while not self.stop.is_set():
                        await self._batch(kv)
            except (OSError, TimeoutError, StatusError) as error:
                self.errors.append(repr(error))
                await asyncio.sleep(0.2)

    async def _batch(self, kv: KvClient) -> None:
        items = [
            (f"w-{self.rng.randrange(3000):05d}".encode(), f"W-{self.batches}-{j}".encode())
            for j in range(150)
        ]
        await upsert_retrying(kv, items, chunk=150)
        for _ in range(5):
            with contextlib.suppress(KeyNotFoundError):
                await kv.remove(f"w-{self.rng.randrange(3000):05d}".encode())
        self.batches += 1
        await asyncio.sleep(0.02)

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the writer did not stop"


def wait_until(what: Any, check: Any, timeout_s: float, query: Any) -> None:
    """Poll ``check`` while the query runs; ``what`` (text, or a function giving it) says
    what did not happen in time."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert query.isActive, f"the query stopped: {query.exception()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what() if callable(what) else what}")
        time.sleep(0.25)


def test_streaming_mirror_follows_a_failover_without_restarting(
    spark: Any,
    nodes: NodeFactory,
    etcd: EtcdServer,
    cluster_name: str,
    tmp_path: Path,
    rng: random.Random,
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, vbuckets=VBUCKETS,
        extra=FAST_NODE, failover_timeout_s=FAILOVER_TIMEOUT_S,
    )  # fmt: skip
    n1, n2, n3 = cluster
    write(n1.port, workload(rng, 4000, keys=3000, prefix="w"))
    asyncio.run(wait_replicated(cluster))
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))  # else failover is refused
    before = asyncio.run(cluster_map(n1))
    n3_vbs = actives_by_port(before)[n3.port]
    assert n3_vbs, "n3 leads some vbuckets"

    tables = tmp_path / "tables"
    # n3, the node killed, is a seed too, but not the first: MirrorWriter's rollback re-read
    # dials the first seed only (see the report / spark/mirror.py).
    options = {
        "cluster": seeds(n1, n2, n3),
        "format": "binary",
        "failOnDataLoss": "false",
        "maxOffsetsPerTrigger": "3000",
    }
    query = (
        spark.readStream.format("changefeed").options(**options).load()
        .writeStream.foreachBatch(MirrorWriter(tables, options))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="0.5 seconds").start()
    )  # fmt: skip
    try:
        with Writer(n1.port, rng) as writer:
            wait_until(
                "two micro-batches with rows",
                lambda: len([p for p in query.recentProgress if p["numInputRows"]]) >= 2,
                60,
                query,
            )
            batches_before_kill = query.lastProgress["batchId"]
            n3.kill()
            killed = time.monotonic()

            def failed_over() -> bool:
                moved = asyncio.run(cluster_map(n1))
                return all(
                    (a := moved.active(vb)) is not None and a.port != n3.port for vb in n3_vbs
                )

            wait_until("n3's vbuckets failed over", failed_over, 30, query)
            print(f"failed over {time.monotonic() - killed:.1f} s after the kill")
            written = writer.batches
            wait_until(
                "writes after the failover", lambda: writer.batches > written + 20, 30, query
            )
        print(f"writer: {writer.batches} batches, {len(writer.errors)} errors {writer.errors[:3]}")

        truth: dict[str, Any] = {}
        mirror: dict[str, Any] = {}

        def converged() -> bool:
            nonlocal truth, mirror
            truth = store_state(n1)  # from every vbucket's active (n1 and n2 now)
            with contextlib.suppress(Exception):  # no table yet, or a commit under way
                mirror = table_state(read_mirror(tables))
            return mirror == truth

        wait_until(lambda: f"mirror == store ({diff(mirror, truth)})", converged, CONVERGE_S, query)
        assert query.isActive and query.exception() is None, query.exception()
        after = [p for p in query.recentProgress if p["batchId"] > batches_before_kill]
        assert any(p["numInputRows"] for p in after), "micro-batches after the kill read rows"
        moved_keys = [k for k, d in truth.items() if d.vbucket in n3_vbs]
        assert moved_keys, "keys of the failed-over vbuckets are in the store"
        log = changelog(tables)
        rollbacks = log.filter(pc.equal(log.column("op"), "rollback"))
        planning = [p["durationMs"].get("latestOffset", 0) for p in after]
        print(
            f"mirror == store: {len(truth)} keys ({len(moved_keys)} in vbuckets moved off n3), "
            f"{query.lastProgress['batchId'] + 1} micro-batches, one query; rollback rows "
            f"{rollbacks.select(['vbucket', 'seqno']).to_pylist()}; slowest planning after "
            f"the kill {max(planning, default=0)} ms"
        )
    finally:
        query.stop()
