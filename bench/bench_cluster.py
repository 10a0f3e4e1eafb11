"""Cluster benchmark (issue 11): replica catch-up, ingest with replicas, replication lag.

Real processes on loopback: one etcd (``EtcdServer``) and nodes through the one launcher
(``NodeProcess``), each cluster under its own name in that etcd, everything under a temporary
directory. Default (durable: fsync per commit) nodes, 64 vbuckets. Rows:

1. **Catch-up rate, from memory and from disk.** Two nodes, replicas 1, catch-up rate limit off
   (``replication_catchup_bytes_per_s = 0``), checkpoint quota 1 GiB on both. Once n2's replica
   streams are open on n1, n2 is killed (-9), N items are written to the vbuckets whose active
   is n1, then n2 is started again and timed from the moment it serves until its replica high
   seqnos equal n1's (STAT vbucket-seqno polled every 20 ms). Memory: n1 kept n2's cursors, so
   the gap is in its checkpoints. Disk: n1 is killed and restarted after the writes (persisted
   first), so its memory is gone, before n2 comes back. n1's ``dcp_backfills_started`` over the
   catch-up says which path was taken. Peer, same cluster, just before n2 restarts: one
   ``DcpClient`` streaming the same vbuckets from n1 from 0 to the high seqno at request time
   (bench_node.py's ``stream_all``). Goal: the catch-up at >= 0.9x the peer's items/s.
2. **Ingest with replicas = 0, 1, 2**, a fresh 3-node cluster each: the same N items through
   ``KvClient.upsert_many`` (one client, routed by the map, one call: two windows of
   ``PIPELINE_DEPTH_MAX`` in flight).
   ops/s counts until the last write is acknowledged; the CPU of the three nodes is counted
   until every replica has caught up too (replication is asynchronous: its cost is included).
   Goal: replicas=1 keeps >= 70 % of the replicas=0 throughput.
3. **Replication lag under a steady writer**: 3 nodes, replicas 1, single-key SETs at a fixed
   rate (open loop, ``--lag-rate`` ops/s for ``--lag-seconds``); every ``--lag-sample``-th
   write is followed by GET_REPLICA polls (every 1 ms, a second client) until the replica
   returns the value written; lag = first such answer - the write's acknowledgement. Once on
   default nodes and once on ``--no-durable`` ones (the fsyncs' share of the lag).
4. **Durable writes** (``--only durable``, issue 29 item 3): 3 nodes, replicas 1, one
   cluster; N items through ``KvClient.upsert_many`` with ``durability="none"`` and then
   ``"majority"``, interleaved ``--durable-reps`` times, new keys each time. ops/s counts
   until the last write is acknowledged, CPU of the three nodes over the same interval.
   Goal: majority >= 0.6x the throughput of none. ``--profile TOP`` with ``--only durable``
   samples the node active for the most vbuckets during the majority runs (py-spy).

Why kill -9 and hour-long leases (``failover_timeout_s = 3600``): with the tree as it is, a
clean stop of a node revokes its lease at once and the orchestrator changes the map (failover),
after which the returning replica's catch-up comes from disk whatever the quota; and with the
default 3 s lease a node busy with ingest on this loaded machine can miss its keep-alives and
lose its membership. The benchmark measures neither (failover is issue 12).

CPU per item is user + system time of the node processes over the measured interval
(/proc/<pid>/stat), divided by the items: on this shared machine throughput moves with other
load, CPU per item much less. "client" is this process (the DCP peer's consumer).

Usage::

    .venv/bin/python bench/bench_cluster.py                  # N = 200,000 (~5 min here)
    .venv/bin/python bench/bench_cluster.py --items 1000000  # the issue's size (~20 min)
    .venv/bin/python bench/bench_cluster.py --quick          # N = 20,000, a smoke run
    PATH=$PATH:DIR_OF_PY_SPY .venv/bin/python bench/bench_cluster.py --items 100000 --profile 10

The table goes to stdout and to ``--results`` (default bench/results_cluster.txt; ``-`` for
none). ``--profile TOP`` runs only the catch-up rows with py-spy (``pip install py-spy``) on
both nodes and prints their top functions. Every process started is stopped on the way out (by
pid), also on SIGTERM/SIGINT; a failed run keeps its work directory (node and etcd logs) and
says where.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    KvClient,
    Snapshot,
    StreamEnded,
    StreamRefused,
)
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call, connect
from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap, vbucket_for_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_node import cpu_seconds, log, machine, run_loop
from node_bench_procs import SpySampler, node_process, stop_children, top_self_time

VBUCKETS = 64
VALUE_BYTES = 100
KEY_FORMAT = b"key%08d"  # 11 bytes
QUOTA_BYTES = 1 << 30  # far above the gap: n1 keeps it all in memory while n2 is down
POLL_S = 0.02  # catch-up: STAT vbucket-seqno of the replica every 20 ms
LAG_POLL_S = 0.001
MAP_WAIT_S = 60.0
CATCHUP_DEADLINE_S = 600.0
STREAM_DEADLINE_S = 600.0
REPLICATED_DEADLINE_S = 300.0
LAG_SEEN_DEADLINE_S = 30.0
GOAL_CATCHUP = 0.9
# Node leases of an hour: no failover during a run. With the default 3 s, a node whose event
# loop is busy for 3 s under ingest on this shared machine loses its membership, and a clean
# stop of a replica changes the map (failover); the benchmark measures neither.
FAILOVER_TIMEOUT_S = 3600
GOAL_REPLICAS_COST = 0.30
GOAL_MAJORITY = 0.6

# For the signal handler: the etcd of the run (nodes are found by stop_children()).
_ETCD: list[EtcdServer] = []


def value_of(n: int) -> bytes:
    return b"%0*d" % (VALUE_BYTES, n)


# -- measuring ------------------------------------------------------------------------------


class CpuMeter:
    """Wall time of a block and the CPU seconds each of ``pids`` used meanwhile (this process
    too: the ``client``)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.seconds = 0.0
        self.cpu: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._client = time.process_time()
        self._started = time.perf_counter()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def stop(self) -> None:
        """End the measured interval (leaving the block ends it too, unless done already)."""
        if self.cpu:
            return
        self.seconds = time.perf_counter() - self._started
        self.cpu = {n: cpu_seconds(p) - self._before[n] for n, p in self.pids.items()}
        self.cpu["client"] = time.process_time() - self._client

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Row:
    """One line of the table: ``items`` in ``seconds``; ``cpu`` in seconds per process."""

    label: str
    items: int
    seconds: float
    cpu: dict[str, float]
    nodes: Sequence[str]  # the keys of ``cpu`` that are node processes
    peer: Row | None = None
    notes: list[str] = field(default_factory=list)
    lag_ms: tuple[float, float] | None = None  # replication lag p50, p99 (the lag rows)

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("inf")

    @property
    def ratio(self) -> float | None:
        return self.rate / self.peer.rate if self.peer is not None else None

    def us_per_item(self, names: Sequence[str]) -> float:
        return 1e6 * sum(self.cpu.get(n, 0.0) for n in names) / max(1, self.items)

    def cpu_note(self, seconds: float | None = None) -> str:
        """CPU per item of each process, and its share of a core over ``seconds`` (default:
        the row's)."""
        seconds = seconds or self.seconds
        parts = [f"{n} {1e6 * s / max(1, self.items):.1f}" for n, s in self.cpu.items()]
        share = ", ".join(f"{n} {100 * s / seconds:.0f}%" for n, s in self.cpu.items())
        return f"CPU us/item: {', '.join(parts)}; % of a core: {share}"


# -- talking to nodes -----------------------------------------------------------------------


async def open_conn(port: int) -> Connection:
    return await connect(
        HOST, port, agent="bench-cluster", user="Administrator", password="password",
        bucket="default",
    )  # fmt: skip


async def stat(port: int, group: str, conn: Connection | None = None) -> dict[str, str]:
    """STAT ``group`` of the node on ``port`` (on ``conn`` if given, else a new connection)."""
    own = conn is None
    c = conn or await open_conn(port)
    try:
        opaque = c.next_opaque()
        request = encode_request(Opcode.STAT, opaque=opaque, key=group.encode())
        frames = await c.request_many(
            request, opaque, lambda f: f.status != Status.SUCCESS or not f.key, timeout_s=10.0
        )
    finally:
        if own:
            await c.close()
    assert frames[-1].status == Status.SUCCESS, (group, frames[-1].status)
    return {f.key.decode(): f.value.decode() for f in frames[:-1]}


def highs_of(found: dict[str, str]) -> dict[int, int]:
    """vb -> high seqno from a STAT vbucket-seqno answer."""
    return {int(k[3:].split(":")[0]): int(v) for k, v in found.items() if k.endswith(":high_seqno")}


async def cluster_map(port: int) -> ClusterMap:
    conn = await open_conn(port)
    try:
        body = (await call(conn, Opcode.GET_CLUSTER_CONFIG)).value
    finally:
        await conn.close()
    return ClusterMap.from_couchbase_config(json.loads(body))


async def wait_for_map(port: int, count: int) -> ClusterMap:
    """The map the node serves once it places every vbucket on the ``count`` nodes."""
    deadline = time.monotonic() + MAP_WAIT_S
    while True:  # bounded by MAP_WAIT_S
        found = await cluster_map(port)
        if found.rev >= 1 and len(found.nodes) >= count:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"node on {port} serves no {count}-node map in {MAP_WAIT_S} s")
        await asyncio.sleep(0.1)


async def wait_replicated(nodes: list[NodeProcess], cmap: ClusterMap, deadline_s: float) -> None:
    """Until every replica copy's high seqno equals its active's."""
    deadline = time.monotonic() + deadline_s
    conns = {n.port: await open_conn(n.port) for n in nodes}
    try:
        while True:  # bounded by deadline_s
            highs = {p: highs_of(await stat(p, "vbucket-seqno", c)) for p, c in conns.items()}
            behind = [
                vb
                for vb in range(cmap.vbuckets)
                for replica in cmap.replica_nodes(vb)
                if highs[replica.port].get(vb, -1) != highs[cmap.active(vb).port][vb]  # type: ignore[union-attr]
            ]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas behind after {deadline_s} s: vbuckets {behind[:8]}")
            await asyncio.sleep(POLL_S)
    finally:
        for conn in conns.values():
            await conn.close()


# -- clusters -------------------------------------------------------------------------------


def node_args(
    endpoint: str, cluster: str, name: str, count: int, replicas: int, extra: Sequence[str]
) -> list[str]:
    args = [
        "--etcd", endpoint, "--cluster", cluster, "--node-name", name,
        "--replicas", str(replicas), "--expected-nodes", str(count), *extra,
    ]  # fmt: skip
    return args


class Cluster:
    """``count`` nodes n1..nN of cluster ``name`` in ``etcd``, under ``root``; stopped on exit.

    Every node gets a config file with ``failover_timeout_s = FAILOVER_TIMEOUT_S`` plus
    ``config``, and the serve flags ``extra``."""

    def __init__(
        self, etcd: EtcdServer, root: Path, name: str, *, count: int, replicas: int,
        extra: Sequence[str] = (), config: dict[str, object] | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.count = count
        values = {"failover_timeout_s": FAILOVER_TIMEOUT_S, **(config or {})}
        config_path = config_file(root / name / "config.toml", **values)
        extra = ["--config", str(config_path), *extra]
        self.nodes = [
            node_process(
                root / name / f"n{i}",
                vbuckets=VBUCKETS,
                extra=node_args(etcd.endpoint, name, f"n{i}", count, replicas, extra),
            )
            for i in range(1, count + 1)
        ]
        self.map: ClusterMap | None = None

    def __enter__(self) -> Cluster:
        try:
            for node in self.nodes:
                node.start()
            for node in self.nodes:
                self.map = run_loop(wait_for_map(node.port, self.count))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.ExitStack() as stack:  # every node is stopped even if one fails
            for node in self.nodes:
                stack.callback(_stop_node, node)

    def pids(self) -> dict[str, int]:
        return {f"n{i}": n.pid for i, n in enumerate(self.nodes, 1) if n.alive}


def _stop_node(node: NodeProcess) -> None:
    if node.process is None:
        return
    with contextlib.suppress(TimeoutError):  # then stop() killed it
        node.stop(check=False)


def config_file(path: Path, **values: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


# -- 1. catch-up ----------------------------------------------------------------------------


def keys_active_on(
    cmap: ClusterMap, port: int, count: int, *, prefix: bytes = b""
) -> list[tuple[bytes, bytes]]:
    """``count`` items whose vbucket's active is the node on ``port``."""
    items: list[tuple[bytes, bytes]] = []
    n = 0
    while len(items) < count:
        key = prefix + KEY_FORMAT % n
        active = cmap.active(vbucket_of(cmap, key))
        if active is not None and active.port == port:
            items.append((key, value_of(n)))
        n += 1
    return items


def vbucket_of(cmap: ClusterMap, key: bytes) -> int:
    return vbucket_for_key(key, cmap.vbuckets)


async def write(port: int, items: list[tuple[bytes, bytes]]) -> None:
    async with await KvClient.connect(HOST, port) as kv:
        for first in range(0, len(items), PIPELINE_DEPTH_MAX):
            await kv.upsert_many(items[first : first + PIPELINE_DEPTH_MAX])


@dataclass
class StreamCount:
    items: int = 0
    from_memory: int = 0
    from_disk: int = 0

    @property
    def source(self) -> str:
        return "+".join(k for k, v in (("memory", self.from_memory), ("disk", self.from_disk)) if v)


async def stream_peer(
    port: int, vbuckets: list[int], highs: dict[int, int], meter: CpuMeter
) -> StreamCount:
    """One DcpClient streams ``vbuckets`` from the node on ``port`` from 0 to the latest
    (bench_node.py's ``stream_all``), inside ``meter``; items under memory/disk markers."""
    config = ClientConfig(host=HOST, port=port, to_latest=True, follow_map=False)
    out = StreamCount()
    snap_end = dict.fromkeys(vbuckets, 0)
    ended = 0
    async with DcpClient(config) as client:
        async with asyncio.timeout(STREAM_DEADLINE_S):
            with meter:
                await client.stream(vbuckets)
                async for event in client.events():
                    if isinstance(event, Changes):
                        out.items += len(event.columns)
                    elif isinstance(event, Snapshot):
                        span = event.snap_end - snap_end[event.vbucket]
                        snap_end[event.vbucket] = event.snap_end
                        if event.flags & MarkerFlag.MEMORY:
                            out.from_memory += span
                        else:
                            out.from_disk += span
                    elif isinstance(event, StreamEnded):
                        ended += 1
                        if ended == len(vbuckets):
                            break
                    elif isinstance(event, StreamRefused):
                        raise RuntimeError(f"stream refused: {event}")
        got = {vb: client.session.get(vb).seqno for vb in vbuckets}
    assert got == {vb: highs[vb] for vb in vbuckets}, "the peer stream is short"
    assert out.items == sum(highs[vb] for vb in vbuckets), (out.items, highs)
    return out


async def wait_streams_open(port: int, vbuckets: list[int], replica: str) -> None:
    """Until the active on ``port`` has a connected stream of ``replica`` for every vb."""
    deadline = time.monotonic() + MAP_WAIT_S
    while True:  # bounded by MAP_WAIT_S
        found = await stat(port, "replication")
        if all(found.get(f"vb_{vb}:replica:{replica}:connected") == "1" for vb in vbuckets):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replica}'s streams not all open on {port} in {MAP_WAIT_S} s")
        await asyncio.sleep(POLL_S)


async def wait_replica_streams(cmap: ClusterMap) -> None:
    """Until every active has a connected stream of each of its vbuckets' replicas."""
    deadline = time.monotonic() + MAP_WAIT_S
    for node in cmap.nodes:
        mine = [vb for vb in range(VBUCKETS) if cmap.active(vb) == node]
        while True:  # bounded by MAP_WAIT_S
            found = await stat(node.port, "replication")
            open_ = {
                k.split(":")[0] for k, v in found.items() if k.endswith(":connected") and v == "1"
            }
            if all(f"vb_{vb}" in open_ for vb in mine):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica streams not all open on {node.port}")
            await asyncio.sleep(POLL_S)


async def wait_persisted(port: int) -> None:
    """Until the node has persisted every vbucket up to its high seqno."""
    deadline = time.monotonic() + REPLICATED_DEADLINE_S
    while True:  # bounded by REPLICATED_DEADLINE_S
        found = await stat(port, "vbucket-seqno")
        if all(found[k.replace("high_seqno", "last_persisted_seqno")] == v
               for k, v in found.items() if k.endswith(":high_seqno")):  # fmt: skip
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"node on {port} not persisted in {REPLICATED_DEADLINE_S} s")
        await asyncio.sleep(POLL_S)


async def wait_caught_up(
    port: int, want: dict[int, int], meter: CpuMeter, base: dict[int, int] | None = None
) -> list[tuple[float, int]]:
    """Poll the replica on ``port`` until its high seqno of every vb in ``want`` equals it.

    Returns the polls' timeline: (seconds since ``meter`` started, items the replica took
    beyond ``base``, its high seqnos before), so that the wait before the first item
    (connect, handshake, stream requests) shows apart from the rate once items flow."""
    conn = await open_conn(port)  # this SCRAM handshake runs while the replica catches up
    base = base or {}
    timeline: list[tuple[float, int]] = []
    try:
        deadline = time.monotonic() + CATCHUP_DEADLINE_S
        while True:  # bounded by CATCHUP_DEADLINE_S
            highs = highs_of(await stat(port, "vbucket-seqno", conn))
            took = sum(max(0, highs.get(vb, 0) - base.get(vb, 0)) for vb in want)
            timeline.append((meter.elapsed(), took))
            if all(highs.get(vb, -1) >= seqno for vb, seqno in want.items()):
                meter.stop()
                assert all(highs[vb] == seqno for vb, seqno in want.items()), "replica ahead?"
                return timeline
            if time.monotonic() > deadline:
                behind = {vb: (highs.get(vb), s) for vb, s in want.items() if highs.get(vb) != s}
                raise TimeoutError(f"catch-up not done in {CATCHUP_DEADLINE_S} s: {behind}")
            await asyncio.sleep(POLL_S)
    finally:
        await conn.close()


def bench_catchup(
    etcd: EtcdServer, work: Path, n: int, source: str, profile_top: int = 0
) -> tuple[Row, Row]:
    """Catch-up of n2 after ``n`` writes to n1's vbuckets, and the peer DCP stream.

    With ``profile_top``, py-spy samples n1 and n2 during the catch-up and the row's notes get
    their top functions by own time (the sampling costs CPU: figures of such a run are not
    comparable)."""
    extra = ["--checkpoint-quota-bytes", str(QUOTA_BYTES)]
    config: dict[str, object] = {"replication_catchup_bytes_per_s": 0}
    name = f"catchup-{source}"
    with Cluster(etcd, work, name, count=2, replicas=1, extra=extra, config=config) as cluster:
        n1, n2 = cluster.nodes
        assert cluster.map is not None
        cmap = cluster.map
        mine = [vb for vb in range(VBUCKETS) if cmap.active(vb).port == n1.port]  # type: ignore[union-attr]
        run_loop(wait_streams_open(n1.port, mine, "n2"))  # n2's cursors are placed on n1
        items = keys_active_on(cmap, n1.port, n)
        n2.kill()  # see the module docstring: a clean stop changes the map today
        log(f"catch-up from {source}: n2 killed; writing {n:,} items to n1's {len(mine)} vbs")
        started = time.perf_counter()
        run_loop(write(n1.port, items))
        log(f"  written in {time.perf_counter() - started:.1f} s")
        if source == "disk":
            run_loop(wait_persisted(n1.port))
            n1.kill()  # its checkpoints, n2's cursors with them, are gone on restart
            n1.start()
            run_loop(wait_for_map(n1.port, 2))
        highs = {vb: s for vb, s in highs_of(run_loop(stat(n1.port, "vbucket-seqno"))).items()}
        want = {vb: highs[vb] for vb in mine}
        assert sum(want.values()) == n, (sum(want.values()), n)

        backfills_0 = int(run_loop(stat(n1.port, ""))["dcp_backfills_started"])
        peer_meter = CpuMeter({"n1": n1.pid})
        counted = run_loop(stream_peer(n1.port, mine, highs, peer_meter))
        general = run_loop(stat(n1.port, ""))
        peer_backfills = int(general["dcp_backfills_started"]) - backfills_0
        peer = Row(
            f"DCP stream, 1 consumer ({source})", counted.items, peer_meter.seconds,
            peer_meter.cpu, ["n1"],
        )  # fmt: skip
        peer.notes.append(
            f"items under markers: {counted.from_memory:,} memory, {counted.from_disk:,} disk "
            f"-> {counted.source}; n1 backfills started: {peer_backfills}"
        )
        peer.notes.append(peer.cpu_note())
        log(f"  peer DCP stream {peer.rate:,.0f} items/s ({counted.source})")

        backfills_1 = int(general["dcp_backfills_started"])
        catchup_bytes_1 = int(general.get("replication_catchup_bytes", "0"))
        with contextlib.ExitStack() as spies:
            if profile_top:
                spies.enter_context(SpySampler(n1.pid, work / f"spy-{source}-{n1.pid}.txt"))
            n2.start()  # serving (ready file) when it returns: the clock starts there
            if profile_top:  # attaching takes ~0.5 s, part of the catch-up is not sampled
                spies.enter_context(SpySampler(n2.pid, work / f"spy-{source}-{n2.pid}.txt"))
            meter = CpuMeter({"n1": n1.pid, "n2": n2.pid})
            with meter:
                timeline = run_loop(wait_caught_up(n2.port, want, meter))
        general = run_loop(stat(n1.port, ""))
        backfills = int(general["dcp_backfills_started"]) - backfills_1
        catchup_bytes = int(general.get("replication_catchup_bytes", "0")) - catchup_bytes_1
        replication = run_loop(stat(n1.port, "replication"))
        feeds = run_loop(stat(n2.port, "replica-feeds"))
        row = Row(
            f"catch-up from {source.upper()} (n1 -> n2)", n, meter.seconds, meter.cpu,
            ["n1", "n2"], peer=peer,
        )  # fmt: skip
        path = "disk" if backfills else "memory"
        row.notes.append(
            f"n1 dcp_backfills_started during catch-up: {backfills} -> path: {path}"
            f"{'' if path == source else f' (EXPECTED {source})'}; catch-up bytes charged "
            f"to the rate bound: {catchup_bytes:,}; n1 replication_catchup_seconds_last "
            f"{float(replication.get('replication_catchup_seconds_last', 0)):.2f} s; n2 "
            f"feed items {feeds.get('n1:items', '?')}, rollbacks {feeds.get('n1:rollbacks', '?')}"
        )
        row.notes.append(
            row.cpu_note() + f"; (peer: nodes = n1 only, the consumer is the bench process "
            f"at {peer.us_per_item(['client']):.1f} us/item)"
        )
        row.notes.append(timeline_note(timeline, n))
        if profile_top:
            row.notes.append(
                "PROFILED: the clock started once py-spy had attached to n2 (~0.5 s late), so "
                "items/s and CPU/item are overstated; only the function lists mean anything"
            )
        for name, node in (("n1 (active)", n1), ("n2 (replica)", n2)) if profile_top else ():
            row.notes.append(f"{name}: top functions by own time, % of busy samples (py-spy)")
            row.notes.extend(top_self_time(work / f"spy-{source}-{node.pid}.txt", profile_top))
        log(f"  catch-up {row.rate:,.0f} items/s, backfills {backfills}")
        return peer, row


def timeline_note(timeline: list[tuple[float, int]], n: int) -> str:
    """When the replica's first items showed (the polls are ``POLL_S`` apart), and its rate
    from there to the end: the connect/handshake/request wait apart from the flowing rate."""
    first = next((i for i, (_, took) in enumerate(timeline) if took), len(timeline) - 1)
    t_first, took_first = timeline[first]
    t_end, _ = timeline[-1]
    span = t_end - t_first
    flowing = (n - took_first) / span if span > 0 else float("nan")
    half = next((t for t, took in timeline if took * 2 >= n), t_end)
    return (
        f"timeline: first items seen at {t_first:.2f} s ({took_first:,}), half at {half:.2f} s, "
        f"all at {t_end:.2f} s; {flowing:,.0f} items/s from the first poll with items"
    )


# -- 2. ingest with replicas ----------------------------------------------------------------


def bench_ingest(etcd: EtcdServer, work: Path, n: int, replicas: int, base: Row | None) -> Row:
    with Cluster(etcd, work, f"ingest-r{replicas}", count=3, replicas=replicas) as cluster:
        assert cluster.map is not None
        items = [(KEY_FORMAT % i, value_of(i)) for i in range(n)]
        log(f"ingest, 3 nodes, replicas {replicas}: {n:,} items")
        meter = CpuMeter(cluster.pids())

        async def run() -> float:
            async with await KvClient.connect(HOST, cluster.nodes[0].port) as kv:
                with meter:
                    await kv.upsert_many(items)  # two windows in flight
                    acked_s = meter.elapsed()
                    assert cluster.map is not None
                    await wait_replicated(cluster.nodes, cluster.map, REPLICATED_DEADLINE_S)
            return acked_s

        acked_s = run_loop(run())
        nodes = list(cluster.pids())
        row = Row(f"ingest, replicas={replicas}", n, acked_s, meter.cpu, nodes, peer=base)
        row.peer = row.peer or row  # replicas=0: its own peer (1.00x)
        row.notes.append(
            f"replicas equal to their actives {meter.seconds - acked_s:.2f} s after the last "
            f"ack; CPU counted until then: {row.cpu_note(meter.seconds)}"
        )
        log(f"  {row.rate:,.0f} ops/s, nodes {row.us_per_item(nodes):.1f} us/op")
        return row


# -- 4. durable writes -----------------------------------------------------------------------


async def durable_ingest(
    port: int, items: list[tuple[bytes, bytes]], level: str, meter: CpuMeter
) -> None:
    async with await KvClient.connect(HOST, port) as kv:
        with meter:
            await kv.upsert_many(items, durability=level)  # type: ignore[arg-type]


def bench_durable(
    etcd: EtcdServer, work: Path, n: int, reps: int, profile_top: int = 0
) -> list[Row]:
    """``none`` then ``majority`` ingest, ``reps`` times, in one 3-node cluster, replicas 1;
    each majority row's peer is the none row just before it."""
    rows: list[Row] = []
    with Cluster(etcd, work, "durable-r1", count=3, replicas=1) as cluster:
        cmap = cluster.map
        assert cmap is not None
        busiest = max(cluster.nodes, key=lambda node: sum(
            1 for vb in range(VBUCKETS) if cmap.active(vb).port == node.port  # type: ignore[union-attr]
        ))  # fmt: skip
        run_loop(wait_replica_streams(cmap))  # else a majority write is refused
        for rep in range(reps):
            base: Row | None = None
            for level in ("none", "majority"):
                items = [(b"%s%d-%08d" % (level[:1].encode(), rep, i), value_of(i))
                         for i in range(n)]  # fmt: skip
                log(f"durable ingest, 3 nodes, replicas 1, durability {level}: {n:,} items")
                meter = CpuMeter(cluster.pids())
                spy = work / f"spy-durable-{rep}-{busiest.pid}.txt"
                with contextlib.ExitStack() as spies:
                    if profile_top and level == "majority":
                        spies.enter_context(SpySampler(busiest.pid, spy))

                    run_loop(durable_ingest(cluster.nodes[0].port, items, level, meter))
                nodes = list(cluster.pids())
                row = Row(f"ingest, replicas=1, durability={level}", n, meter.seconds,
                          meter.cpu, nodes, peer=base)  # fmt: skip
                row.peer = row.peer or row
                row.notes.append(row.cpu_note())
                if profile_top and level == "majority":
                    row.notes.append(
                        f"the busiest active (pid {busiest.pid}): top functions "
                        "by own time, % of busy samples (py-spy)"
                    )
                    row.notes.extend(top_self_time(spy, profile_top))
                base = base or row
                rows.append(row)
                log(f"  {row.rate:,.0f} ops/s, nodes {row.us_per_item(nodes):.1f} us/op")
    return rows


# -- 3. replication lag ---------------------------------------------------------------------


async def open_every_connection(kv: KvClient, reader: KvClient) -> None:
    """Write through ``kv`` to every active and read through ``reader`` from every replica
    before the clock starts: KvClient opens a node's connection on first use, and two
    concurrent first uses would open two (one leaks)."""
    cmap = kv.cluster_map
    assert cmap is not None
    writers: set[int] = set()
    readers: set[int] = set()
    for n in range(100_000):
        key = b"warm%06d" % n
        vb = vbucket_of(cmap, key)
        active, replica = cmap.active(vb), cmap.replica_nodes(vb)[0]
        assert active is not None
        if active.port not in writers or replica.port not in readers:
            await kv.upsert(key, b"x")
            writers.add(active.port)
            while True:  # bounded: the replica gets the key within the lag
                with contextlib.suppress(KeyNotFoundError):
                    await reader.get_replica(key, 1)
                    break
                await asyncio.sleep(LAG_POLL_S)
            readers.add(replica.port)
        if len(writers) == len(readers) == len(cmap.nodes):
            return
    raise AssertionError(f"no key reaches every node: {writers}, {readers}")


async def steady_writer(
    port: int, rate: int, seconds: float, sample: int, meter: CpuMeter
) -> tuple[int, list[float], int]:
    """Open-loop SETs at ``rate``/s; returns (writes, lags in s of the sampled, unseen)."""
    tick_s = 0.01
    per_tick = max(1, round(rate * tick_s))
    total = int(rate * seconds)
    lags: list[float] = []
    unseen = 0
    async with (
        await KvClient.connect(HOST, port) as kv,
        await KvClient.connect(HOST, port) as reader,
    ):
        await open_every_connection(kv, reader)

        async def one(i: int) -> None:
            nonlocal unseen
            key, value = b"lag%08d" % i, value_of(i)
            await kv.upsert(key, value)
            if i % sample:
                return
            acked = time.perf_counter()
            deadline = acked + LAG_SEEN_DEADLINE_S
            while time.perf_counter() < deadline:
                with contextlib.suppress(KeyNotFoundError):
                    if (await reader.get_replica(key, 1)).value == value:
                        lags.append(time.perf_counter() - acked)
                        return
                await asyncio.sleep(LAG_POLL_S)
            unseen += 1

        tasks: list[asyncio.Task[None]] = []
        started = time.perf_counter()
        with meter:
            for first in range(0, total, per_tick):
                due = started + (first // per_tick) * tick_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                tasks.extend(
                    asyncio.create_task(one(i)) for i in range(first, min(total, first + per_tick))
                )
            await asyncio.gather(*tasks)
    return total, lags, unseen


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_lag(
    etcd: EtcdServer, work: Path, rate: int, seconds: float, sample: int, *, durable: bool
) -> Row:
    flags = [] if durable else ["--no-durable"]
    name = "lag" if durable else "lag-no-durable"
    with Cluster(etcd, work, name, count=3, replicas=1, extra=flags) as cluster:
        log(f"replication lag ({'durable' if durable else '--no-durable'} nodes): {rate} ops/s "
            f"for {seconds} s, every {sample}th write sampled")  # fmt: skip
        meter = CpuMeter(cluster.pids())
        writes, lags, unseen = run_loop(
            steady_writer(cluster.nodes[0].port, rate, seconds, sample, meter)
        )
        repl = run_loop(stat(cluster.nodes[0].port, "replication"))
    label = f"steady writer, replicas=1{'' if durable else ', --no-durable'}"
    row = Row(label, writes, meter.seconds, meter.cpu, ["n1", "n2", "n3"])
    if lags:
        ms = [1e3 * x for x in lags]
        row.lag_ms = statistics.median(ms), percentile(ms, 0.99)
        row.notes.append(
            f"replication lag (ack -> GET_REPLICA returns it), {len(ms)} samples: p50 "
            f"{row.lag_ms[0]:.1f} ms, p99 {row.lag_ms[1]:.1f} ms, max {max(ms):.1f} ms; not "
            f"seen within {LAG_SEEN_DEADLINE_S:.0f} s: {unseen}"
        )
    row.notes.append(row.cpu_note() + " (GET_REPLICA polls included)")
    in_sync = [v for k, v in repl.items() if k.endswith(":in_sync")]
    row.notes.append(f"n1 STAT replication at the end: {in_sync.count('1')}/{len(in_sync)} in sync")
    log(f"  {row.notes[0]}")
    return row


# -- output ---------------------------------------------------------------------------------


def table(rows: list[Row]) -> list[str]:
    head = (
        f"{'row':<40} {'items':>9} {'seconds':>8} {'items/s':>9} {'ratio | lag p50/p99':>20} "
        f"{'nodes CPU us/item':>17}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        ratio = "-"
        if row.ratio is not None and row.peer is not None:
            what = "peer" if "catch" in row.label else "none" if "durab" in row.label else "r=0"
            ratio = f"{row.ratio:.2f}x {what}"
        elif row.lag_ms is not None:
            ratio = f"{row.lag_ms[0]:.0f} / {row.lag_ms[1]:.0f} ms"
        lines.append(
            f"{row.label:<40} {row.items:>9,} {row.seconds:>8.2f} {row.rate:>9,.0f} "
            f"{ratio:>20} {row.us_per_item(row.nodes):>17.1f}"
        )
        lines.extend(f"    {note}" for note in row.notes)
    return lines


def goals(rows: dict[str, Row]) -> list[str]:
    out = []
    for source in ("memory", "disk"):
        row = rows.get(f"catchup-{source}")
        if row is not None and row.ratio is not None and row.peer is not None:
            cpu = row.peer.us_per_item(["n1", "client"]) / row.us_per_item(["n1", "n2"])
            out.append(
                f"goal catch-up >= {GOAL_CATCHUP}x DCP, from {source}: {row.ratio:.2f}x "
                f"({'met' if row.ratio >= GOAL_CATCHUP else 'MISSED'}); CPU per item, peer "
                f"(n1 + consumer) / catch-up (n1 + n2): {cpu:.2f}x"
            )
    r0, r1 = rows.get("ingest-r0"), rows.get("ingest-r1")
    if r0 is not None and r1 is not None:
        cost = 1 - r1.rate / r0.rate
        cpu = r1.us_per_item(r1.nodes) / r0.us_per_item(r0.nodes)
        out.append(
            f"goal replicas=1 costs <= {GOAL_REPLICAS_COST:.0%} of throughput: costs {cost:.0%} "
            f"({'met' if cost <= GOAL_REPLICAS_COST else 'MISSED'}); nodes' CPU per op "
            f"{cpu:.2f}x replicas=0"
        )
    majority = [r for r in rows.values() if r.label.endswith("majority") and r.ratio is not None]
    if majority:
        ratios = sorted(r.ratio for r in majority if r.ratio is not None)
        median = ratios[len(ratios) // 2]
        cpu = [r.us_per_item(r.nodes) / r.peer.us_per_item(r.peer.nodes)
               for r in majority if r.peer is not None]  # fmt: skip
        out.append(
            f"goal durability majority >= {GOAL_MAJORITY}x none (3 nodes, replicas 1): "
            f"{', '.join(f'{x:.2f}x' for x in ratios)} "
            f"({'met' if median >= GOAL_MAJORITY else 'MISSED'}); nodes' CPU per op "
            f"{', '.join(f'{x:.2f}x' for x in cpu)} none"
        )
    return out


def source_tree() -> str:
    """The commit measured and how many files under src/ differ from it (read-only git)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"({error})"
        return done.stdout.rstrip("\n")

    changed = git("status", "--porcelain", "--untracked-files=all", "--", "src").splitlines()
    head = git("rev-parse", "--short", "HEAD")
    return f"source: commit {head} + {len(changed)} files changed or new under src/ (uncommitted)"


def report(args: argparse.Namespace, rows: dict[str, Row], total_s: float) -> str:
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        f"command: {command}  (cwd {Path.cwd()})",
        *machine(),
        source_tree(),
        f"items: {args.items:,} (catch-up gap and ingest), {len(KEY_FORMAT % 0)}-byte keys, "
        f"{VALUE_BYTES}-byte values, {VBUCKETS} vbuckets, default (durable) nodes; KV window "
        f"{PIPELINE_DEPTH_MAX}; catch-up: 2 nodes, replicas 1, catch-up rate limit off, "
        f"checkpoint quota {QUOTA_BYTES >> 20} MiB; ingest/lag: 3 nodes",
        "",
        *table(list(rows.values())),
        "",
        *goals(rows),
        f"total wall time {total_s:.0f} s; one run per figure on a shared 2-core machine",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20,000 items, a 3 s lag run")
    parser.add_argument("--lag-rate", type=int, default=2000, help="writes/s of row 3")
    parser.add_argument("--lag-seconds", type=float, default=10.0)
    parser.add_argument("--lag-sample", type=int, default=20, help="sample every Nth write")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="py-spy on both nodes during the catch-ups: print the TOP functions (no results file)",
    )
    parser.add_argument(
        "--only",
        choices=["catchup", "ingest", "lag", "durable"],
        action="append",
        help="rows to run (durable: not in the default set)",
    )
    parser.add_argument("--durable-reps", type=int, default=2, help="none/majority pairs")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent / "results_cluster.txt"),
        help="file for the report; '-' for none",
    )
    args = parser.parse_args()
    if args.quick:
        args.items, args.lag_seconds = 20_000, 3.0
    if args.profile:
        args.only, args.results = (args.only if args.only == ["durable"] else ["catchup"]), "-"
    assert 0 < args.items < 100_000_000, args.items
    return args


@contextlib.contextmanager
def etcd_running(work: Path) -> Iterator[EtcdServer]:
    etcd = EtcdServer(work / "etcd")
    _ETCD.append(etcd)
    try:
        yield etcd.start()
    finally:
        etcd.stop()
        _ETCD.remove(etcd)


def stop_on_signals(work: Path) -> None:
    """On SIGTERM/SIGINT stop every node and etcd this benchmark started, drop `work`, exit:
    a benchmark interrupted must not leave servers behind."""

    def abandon(signum: int, frame: object) -> None:
        log(f"signal {signum}: stopping child processes and exiting")
        stop_children()
        for etcd in _ETCD:
            etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, abandon)
    signal.signal(signal.SIGINT, abandon)


def main() -> None:
    args = parse_args()
    only = set(args.only or ["catchup", "ingest", "lag"])
    work = Path(tempfile.mkdtemp(prefix="bench_cluster_"))

    stop_on_signals(work)
    started = time.perf_counter()
    rows: dict[str, Row] = {}
    try:
        with etcd_running(work) as etcd:
            if "catchup" in only:
                for source in ("memory", "disk"):
                    peer, row = bench_catchup(etcd, work, args.items, source, args.profile)
                    rows[f"peer-{source}"], rows[f"catchup-{source}"] = peer, row
            if "ingest" in only:
                base = None
                for replicas in (0, 1, 2):
                    row = bench_ingest(etcd, work, args.items, replicas, base)
                    base = base or row
                    rows[f"ingest-r{replicas}"] = row
            if "durable" in only:
                for index, row in enumerate(
                    bench_durable(etcd, work, args.items, args.durable_reps, args.profile)
                ):
                    rows[f"durable-{index}"] = row
            if "lag" in only:
                for durable in (True, False):
                    rows[f"lag-{durable}"] = bench_lag(
                        etcd, work, args.lag_rate, args.lag_seconds, args.lag_sample,
                        durable=durable,
                    )  # fmt: skip
    except BaseException:
        log(f"failed: kept {work} (node logs: */n*/node.log, etcd.log) for inspection")
        raise
    shutil.rmtree(work, ignore_errors=True)
    text = report(args, rows, time.perf_counter() - started)
    print(text)
    if args.results != "-":
        Path(args.results).write_text(text + "\n")


if __name__ == "__main__":
    main()
