"""Failover benchmark (issue 12): kill-to-serving, kill-to-consumer-resumed, durable ingest.

Real processes on loopback: one etcd (``EtcdServer``) and three nodes through the one launcher
(``NodeProcess``), replicas 2, 64 vbuckets, default (durable) nodes, node leases of
``--lease`` seconds (``--failover-timeout-s``, default 5 s: a kill -9 is confirmed by refused
connections and failed over without waiting it out, issue 25). Rows:

1. **Failover, ``--runs`` times (>= 10).** Before each run the cluster is in sync: every
   replica's high seqno equals its active's and every active has published an in-sync set
   holding all its replicas (before that, a failover is refused, rightly). The victim is the
   node active for the most vbuckets; runs alternate between a victim that is not the
   orchestrator and one that is (when the orchestrator leads any vbucket), because a new
   orchestrator waits one lease before calling anyone dead, and the two cases differ by that.
   Set up before the kill: a ``KvClient`` bootstrapped from a survivor that has just written
   the probe key (a key of a vbucket the victim leads, so its connection to the victim is
   open), and a ``DcpClient`` streaming every vbucket of the cluster (``follow_map``) that has
   received that write. Then ``kill -9`` of the victim's process group, and three clocks:
   - kill → promoted: etcd's map no longer names the victim as active of any vbucket (polled
     every 20 ms);
   - kill → serving: the client's durable (majority) upsert of the probe key, started right
     after the kill, is acknowledged (by the promoted replica: the client follows the map,
     with its own retry backoff of 50 ms x attempt, at most 0.5 s, which is part of the figure);
   - kill → consumer resumed: the DcpClient receives that new value (its stream moved to the
     new active; a stream that had read past the promoted replica's history gets a rollback
     first, counted).
   Then the victim is started again and timed until it has rejoined (its replica copies
   equal their actives) and the in-sync sets hold it again.
2. **Ingest, ``durability="none"`` vs ``"majority"``**, in the same cluster after the
   failovers, interleaved ``--ingest-reps`` times: N items through ``KvClient.upsert_many`` in
   windows of ``PIPELINE_DEPTH_MAX``, keys new each time. CPU per item is user + system time of
   the three nodes over the interval (/proc/<pid>/stat) and of this process (the client): on
   this shared, noisy machine throughput moves with other load, CPU per item much less. With
   replicas 2 a majority of a vbucket's three copies is two. A build whose nodes answer majority
   writes DURABILITY_IMPOSSIBLE (before SyncWrites) gets "not available: <the node's reason>"
   in that row; any other error (SYNC_WRITE_AMBIGUOUS...) "FAILED: <error>".

Usage::

    .venv/bin/python bench/bench_failover.py                 # 10 runs, 50,000 items per ingest
    .venv/bin/python bench/bench_failover.py --quick         # 3 runs, 5,000 items: a smoke run
    .venv/bin/python bench/bench_failover.py --json          # the figures as JSON on stdout

The table goes to stdout (or JSON with ``--json``) and to ``--results`` (default
bench/results_failover.txt; ``-`` for none). Every process started is stopped on the way out
(by pid), also on SIGTERM/SIGINT; a failed run keeps its work directory (node and etcd logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import Changes, ClientConfig, DcpClient, KvClient, Rollback
from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX, Durability
from changefeed.protocol.errors import DurabilityImpossibleError, StatusError
from changefeed.vbmap import ClusterMap, vbucket_for_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import (
    CpuMeter,
    config_file,
    etcd_running,
    highs_of,
    node_args,
    source_tree,
    stat,
    stop_on_signals,
)
from bench_node import log, machine, run_loop
from node_bench_procs import node_process

CLUSTER = "failover"
NODES = 3
REPLICAS = 2  # a promoted copy and one more make a majority of 3 while the victim is down
VBUCKETS = 64
VALUE_BYTES = 100
LEASE_S = 5  # --failover-timeout-s, the default: a crash is confirmed long before it lapses
POLL_S = 0.02
MEASURE_DEADLINE_S = 60.0  # kill -> each clock; a run that misses it is reported, not hidden
SYNC_DEADLINE_S = 120.0  # rejoin and in-sync sets before the next run
CONSUMER_READY_S = 30.0


# -- the cluster ------------------------------------------------------------------------------


class Cluster:
    """n1..n3 of cluster ``CLUSTER`` in ``etcd`` under ``root``, lease ``lease_s``."""

    def __init__(self, etcd: EtcdServer, root: Path, lease_s: int) -> None:
        self.etcd = etcd
        config = config_file(root / "config.toml", failover_timeout_s=lease_s)
        self.nodes = {
            f"n{i}": node_process(
                root / f"n{i}",
                vbuckets=VBUCKETS,
                extra=node_args(
                    etcd.endpoint, CLUSTER, f"n{i}", NODES, REPLICAS, ["--config", str(config)]
                ),
            )
            for i in range(1, NODES + 1)
        }

    def __enter__(self) -> Cluster:
        try:
            for node in self.nodes.values():
                node.start()
            run_loop(self.wait_map())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.ExitStack() as stack:  # every node is stopped even if one fails
            for node in self.nodes.values():
                stack.callback(_stop_node, node)

    def pids(self) -> dict[str, int]:
        return {name: node.pid for name, node in self.nodes.items() if node.alive}

    async def wait_map(self) -> ClusterMap:
        deadline = time.monotonic() + SYNC_DEADLINE_S
        while True:  # bounded by SYNC_DEADLINE_S
            found = await self.read_map()
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"no map in etcd after {SYNC_DEADLINE_S} s")
            await asyncio.sleep(0.1)

    async def read_map(self) -> ClusterMap | None:
        async with await ClusterMetadata.connect(self.etcd.endpoint, CLUSTER) as md:
            stored = await md.read_map()
        return None if stored is None else stored[0]

    async def leader(self) -> str | None:
        async with await ClusterMetadata.connect(self.etcd.endpoint, CLUSTER) as md:
            found = await md.leader()
        return None if found is None else found[0]

    async def wait_in_sync(self) -> ClusterMap:
        """Until every replica copy's high seqno equals its active's and every active's
        published in-sync set holds all its replicas (the state a failover needs)."""
        deadline = time.monotonic() + SYNC_DEADLINE_S
        async with await ClusterMetadata.connect(self.etcd.endpoint, CLUSTER) as md:
            while True:  # bounded by SYNC_DEADLINE_S
                stored = await md.read_map()
                assert stored is not None
                cmap = stored[0]
                highs = {
                    name: highs_of(await stat(node.port, "vbucket-seqno"))
                    for name, node in self.nodes.items()
                }
                sets = await md.in_sync_sets()
                behind = []
                for vb in range(cmap.vbuckets):
                    active = cmap.active(vb)
                    assert active is not None, (vb, cmap.chains[vb])
                    for replica in cmap.replica_nodes(vb):
                        if highs[replica.name].get(vb) != highs[active.name].get(vb):
                            behind.append((vb, replica.name, "behind"))
                        elif vb not in sets or replica.name not in sets[vb].members:
                            behind.append((vb, replica.name, "not in the in-sync set"))
                if not behind:
                    return cmap
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not in sync after {SYNC_DEADLINE_S} s: {behind[:6]}")
                await asyncio.sleep(POLL_S)


def _stop_node(node: NodeProcess) -> None:
    if node.process is None:
        return
    with contextlib.suppress(TimeoutError):  # then stop() killed it
        node.stop(check=False)


def led_by(cmap: ClusterMap) -> dict[str, list[int]]:
    led: dict[str, list[int]] = {node.name: [] for node in cmap.nodes}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        if active is not None:
            led[active.name].append(vb)
    return led


def choose_victim(cmap: ClusterMap, leader: str | None, want_leader: bool) -> str:
    """The node leading the most vbuckets among the orchestrator (``want_leader``) or the
    others; the other group when the wanted one leads nothing."""
    led = led_by(cmap)
    groups = [
        [n for n in sorted(led) if (n == leader) == want_leader and led[n]],
        [n for n in sorted(led) if led[n]],
    ]
    pool = groups[0] or groups[1]
    return max(pool, key=lambda n: len(led[n]))


# -- one failover -----------------------------------------------------------------------------


@dataclass
class Run:
    """One kill -9 and what each clock saw (seconds from the kill; None: not within the
    deadline)."""

    victim: str
    orchestrator: bool
    led: int
    promoted_s: float | None = None
    serving_s: float | None = None
    consumer_s: float | None = None
    rejoin_s: float | None = None  # from the restart (the node serving) to in sync again
    consumer_rollbacks: int = 0
    client_retries: int = 0
    notes: list[str] = field(default_factory=list)


def probe_key(cmap: ClusterMap, vbuckets: set[int], run: int) -> bytes:
    n = 0
    while True:  # a vbucket of the set is hit within a few hundred keys
        key = b"probe-%d-%d" % (run, n)
        if vbucket_for_key(key, cmap.vbuckets) in vbuckets:
            return key
        n += 1


async def consume(client: DcpClient, key: bytes, wanted: dict[bytes, asyncio.Future[float]],
                  run: Run) -> None:  # fmt: skip
    """Resolve ``wanted[value]`` with the time ``key`` arrives with that value."""
    async for event in client.events():
        if isinstance(event, Rollback):
            run.consumer_rollbacks += 1
        elif isinstance(event, Changes):
            for k, v in zip(event.columns.key, event.columns.value, strict=True):
                if k == key and v in wanted and not wanted[v].done():
                    wanted[v].set_result(time.monotonic())


async def watch_promotion(cluster: Cluster, victim: str, killed: float) -> float | None:
    async with await ClusterMetadata.connect(cluster.etcd.endpoint, CLUSTER) as md:
        while time.monotonic() - killed < MEASURE_DEADLINE_S:
            stored = await md.read_map()
            if stored is not None and not led_by(stored[0])[victim]:
                return time.monotonic() - killed
            await asyncio.sleep(POLL_S)
    return None


async def write_until_served(kv: KvClient, key: bytes, value: bytes, killed: float) -> float | None:
    """A durable (majority) upsert through the map until acknowledged (the client's own
    retries last 15 s)."""
    while time.monotonic() - killed < MEASURE_DEADLINE_S:
        try:
            await kv.upsert(key, value, durability="majority")
            return time.monotonic() - killed
        except (OSError, StatusError):
            continue
    return None


async def one_failover(cluster: Cluster, number: int, want_leader: bool) -> Run:
    cmap = await cluster.wait_in_sync()
    leader = await cluster.leader()
    name = choose_victim(cmap, leader, want_leader)
    victim = cluster.nodes[name]
    led = set(led_by(cmap)[name])
    run = Run(name, name == leader, len(led))
    survivor = next(n for n in cluster.nodes.values() if n is not victim)
    key = probe_key(cmap, led, number)
    before, after = b"before-%d" % number, b"after-%d" % number
    loop = asyncio.get_running_loop()
    wanted = {before: loop.create_future(), after: loop.create_future()}
    config = ClientConfig(host=HOST, port=survivor.port, follow_map=True)
    async with await KvClient.connect(HOST, survivor.port) as kv, DcpClient(config) as client:
        await client.stream(list(range(VBUCKETS)))
        consumer = asyncio.create_task(consume(client, key, wanted, run))
        try:
            await kv.upsert(key, before)  # the client's connection to the victim is open
            await asyncio.wait_for(asyncio.shield(wanted[before]), CONSUMER_READY_S)
            retries = kv.retries
            victim.kill()
            killed = time.monotonic()
            promoted = asyncio.create_task(watch_promotion(cluster, name, killed))
            run.serving_s = await write_until_served(kv, key, after, killed)
            run.client_retries = kv.retries - retries
            remaining = max(0.0, MEASURE_DEADLINE_S - (time.monotonic() - killed))
            with contextlib.suppress(TimeoutError):
                seen = await asyncio.wait_for(asyncio.shield(wanted[after]), remaining)
                run.consumer_s = seen - killed
            run.promoted_s = await promoted
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
    victim.start()
    restarted = time.monotonic()
    await cluster.wait_in_sync()
    run.rejoin_s = time.monotonic() - restarted
    return run


# -- ingest -----------------------------------------------------------------------------------


@dataclass
class Ingest:
    durability: str
    items: int
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    unavailable: str | None = None  # DURABILITY_IMPOSSIBLE: the level is not served (yet)
    failed: str | None = None  # any other error the writes got (e.g. SYNC_WRITE_AMBIGUOUS)
    map_changed: bool = False

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    def us_per_item(self, names: Sequence[str]) -> float:
        return 1e6 * sum(self.cpu.get(n, 0.0) for n in names) / max(1, self.items)


def ingest(cluster: Cluster, durability: Durability, items: int, rep: int) -> Ingest:
    out = Ingest(durability, items)
    data = [(b"%s-%d-%08d" % (durability.encode(), rep, i), b"%0*d" % (VALUE_BYTES, i))
            for i in range(items)]  # fmt: skip
    port = cluster.nodes["n1"].port
    rev = run_loop(cluster.wait_in_sync()).rev
    meter = CpuMeter(cluster.pids())

    async def run() -> None:
        async with await KvClient.connect(HOST, port) as kv:
            with meter:
                for first in range(0, items, PIPELINE_DEPTH_MAX):
                    window = data[first : first + PIPELINE_DEPTH_MAX]
                    await kv.upsert_many(window, durability=durability)

    try:
        run_loop(run())
    except DurabilityImpossibleError as error:
        out.unavailable = str(error) or "DURABILITY_IMPOSSIBLE"
        return out
    except (StatusError, OSError) as error:
        out.failed = f"{type(error).__name__}: {error}"
        return out
    out.seconds, out.cpu = meter.seconds, meter.cpu
    after = run_loop(cluster.read_map())
    out.map_changed = after is None or after.rev != rev
    return out


# -- output -----------------------------------------------------------------------------------


def cell(values: list[float | None]) -> str:
    """``p50 / max (n)`` in seconds; runs that missed the deadline are named."""
    got = [v for v in values if v is not None]
    if not values:
        return "-"
    if not got:
        return f"none of {len(values)}"
    missed = len(values) - len(got)
    text = f"{statistics.median(got):.2f} / {max(got):.2f} ({len(got)})"
    return text + (f" +{missed} missed" if missed else "")


def failover_lines(runs: list[Run]) -> list[str]:
    groups = [
        runs,
        [r for r in runs if not r.orchestrator],
        [r for r in runs if r.orchestrator],
    ]
    head = (f"{'kill -9 of an active -> (seconds: p50 / max (runs))':<52} {'all runs':>18} "
            f"{'victim not orch.':>18} {'victim = orch.':>18}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for title, attribute in (
        ("promoted (etcd's map no longer names it active)", "promoted_s"),
        ("serving (a promoted copy acks a durable write)  ", "serving_s"),
        ("consumer resumed (a DcpClient gets a new change)", "consumer_s"),
        ("restart -> rejoined and in the in-sync sets", "rejoin_s"),
    ):
        cells = [cell([getattr(r, attribute) for r in group]) for group in groups]
        lines.append(f"{title:<52} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}")
    lines.append("")
    lines.append("runs: victim (vbuckets it led) promoted / serving / consumer s; the consumer's "
                 "rollbacks, the client's retries; rejoin s")  # fmt: skip
    for i, r in enumerate(runs, 1):
        lines.append(
            f"  {i:2}. {r.victim} ({r.led} vbs{', orchestrator' if r.orchestrator else ''}) "
            f"{_f(r.promoted_s)} / {_f(r.serving_s)} / {_f(r.consumer_s)}; rollbacks "
            f"{r.consumer_rollbacks}, retries {r.client_retries}; rejoin {_f(r.rejoin_s)}"
        )
    return lines


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ingest_lines(rows: list[Ingest]) -> list[str]:
    head = (f"{'ingest (3 nodes, replicas 2)':<34} {'items':>8} {'seconds':>8} {'items/s':>9} "
            f"{'nodes CPU us/item':>18} {'client us/item':>15}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for row in rows:
        label = f"durability={row.durability}"
        if row.unavailable is not None or row.failed is not None:
            why = (
                f"not available: {row.unavailable}" if row.unavailable else f"FAILED: {row.failed}"
            )
            lines.append(f"{label:<34} {why}")
            continue
        nodes = [n for n in row.cpu if n != "client"]
        lines.append(
            f"{label:<34} {row.items:>8,} {row.seconds:>8.2f} {row.rate:>9,.0f} "
            f"{row.us_per_item(nodes):>18.1f} {row.us_per_item(['client']):>15.1f}"
            + ("  (MAP CHANGED meanwhile: a spurious failover)" if row.map_changed else "")
        )
    return lines


def summary(rows: list[Ingest]) -> list[str]:
    none = [r for r in rows if r.durability == "none" and r.seconds]
    major = [r for r in rows if r.durability == "majority" and r.seconds]
    if not none or not major:
        return []
    rate = statistics.median(r.rate for r in major) / statistics.median(r.rate for r in none)
    cpu = statistics.median(r.us_per_item(list(r.cpu)) for r in major) / statistics.median(
        r.us_per_item(list(r.cpu)) for r in none
    )
    return [f"majority / none, medians: {rate:.2f}x items/s, {cpu:.2f}x CPU per item (all)"]


def report(args: argparse.Namespace, runs: list[Run], rows: list[Ingest], total_s: float) -> str:
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    return "\n".join([
        f"command: {command}  (cwd {Path.cwd()})",
        *machine(),
        source_tree(),
        f"cluster: etcd + {NODES} nodes, replicas {REPLICAS}, {VBUCKETS} vbuckets, default "
        f"(durable) nodes, lease (--failover-timeout-s) {args.lease} s; {len(runs)} failovers",
        "",
        *failover_lines(runs),
        "",
        *ingest_lines(rows),
        *summary(rows),
        f"total wall time {total_s:.0f} s; shared 2-core machine: times move with other load",
    ])  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="failovers (>= 10 for the p50)")
    parser.add_argument("--items", type=int, default=50_000, help="items per ingest")
    parser.add_argument("--ingest-reps", type=int, default=2, help="none/majority pairs")
    parser.add_argument("--lease", type=int, default=LEASE_S, help="--failover-timeout-s")
    parser.add_argument("--quick", action="store_true", help="3 runs, 5,000 items")
    parser.add_argument("--only", choices=["failover", "ingest"], action="append")
    parser.add_argument("--json", action="store_true", help="JSON on stdout instead of the table")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent / "results_failover.txt"),
        help="file for the report; '-' for none",
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.items, args.ingest_reps = 3, 5_000, 1
    assert args.lease >= 2, "etcd leases are whole seconds, at least 2"
    return args


def main() -> None:
    args = parse_args()
    only = set(args.only or ["failover", "ingest"])
    work = Path(tempfile.mkdtemp(prefix="bench_failover_"))

    stop_on_signals(work)
    started = time.perf_counter()
    runs: list[Run] = []
    rows: list[Ingest] = []
    try:
        with etcd_running(work) as etcd, Cluster(etcd, work / CLUSTER, args.lease) as cluster:
            for i in range(args.runs if "failover" in only else 0):
                run = run_loop(one_failover(cluster, i, want_leader=i % 2 == 1))
                runs.append(run)
                log(f"run {i + 1}: {run.victim}{' (orchestrator)' if run.orchestrator else ''} "
                    f"promoted {_f(run.promoted_s)} s, serving {_f(run.serving_s)} s, consumer "
                    f"{_f(run.consumer_s)} s, rejoin {_f(run.rejoin_s)} s")  # fmt: skip
            for rep in range(args.ingest_reps if "ingest" in only else 0):
                durabilities: list[Durability] = ["none", "majority"]
                for durability in durabilities:
                    row = ingest(cluster, durability, args.items, rep)
                    rows.append(row)
                    outcome = row.unavailable or row.failed or f"{row.rate:,.0f} items/s"
                    log(f"ingest {durability}: {outcome}")
    except BaseException:
        log(f"failed: kept {work} (node logs: */n*/node.log, etcd.log) for inspection")
        raise
    shutil.rmtree(work, ignore_errors=True)
    text = report(args, runs, rows, time.perf_counter() - started)
    if args.json:
        out: dict[str, Any] = {
            "lease_s": args.lease, "nodes": NODES, "replicas": REPLICAS, "vbuckets": VBUCKETS,
            "runs": [asdict(r) for r in runs],
            "ingest": [{**asdict(r), "items_per_s": r.rate} for r in rows],
        }  # fmt: skip
        print(json.dumps(out, indent=1))
    else:
        print(text)
    if args.results != "-":
        Path(args.results).write_text(text + "\n")


if __name__ == "__main__":
    main()
