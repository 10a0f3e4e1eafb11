"""``changefeed demo --cluster``: the demo's workload and Spark pipeline on three nodes and etcd,
with the node that leads the most vbuckets killed (SIGKILL) mid-way.

Why: the single-node demo shows exactly-once from a node into Delta; this one shows that it
survives losing a node, the case a cluster exists for (issue 12, item 6). Steps:

1. start etcd and three nodes the way ``changefeed cluster start`` does (its helpers, so there
   is one way to start a cluster; ``NodeProcess`` underneath), with a short lease
   (``--failover-timeout-s``), and write ``cluster.json`` so ``changefeed cluster status --dir``
   works while the demo runs. Placement balances actives, so one of three nodes leads
   ``ceil(V/3)`` vbuckets: 4 vbuckets (the default here) makes that exactly half, the issue's
   "active of half the vbuckets"; with 16 it would be 6 (38 %). The report states the count;
2. the victim is the node active for the most vbuckets (ties: the first by name);
3. the first 20 % of the workload is loaded (the query infers its schema from it), then a
   streaming mirror runs (Spark, processingTime trigger) while the next 20 % is; the query is
   then stopped between micro-batches and started again from its checkpoint (exactly once
   across the restart, as in the single-node demo);
4. once every active has published its in-sync set (before that a failover is refused, and
   rightly so), the rest is loaded; at half the workload the victim is killed with SIGKILL.
   The loader (``KvClient``) follows the map through the failover; a watcher on etcd times the
   kill to the map that promotes replicas. Writes the victim acknowledged but had not
   replicated are lost (they were not durable): the store, not the loader, is the truth, and
   the mirror must follow it, rolling back where it read them;
5. the victim is started again and rejoins as a replica (its streams roll back to the common
   history and catch up; no map change);
6. after the expiry time, every key is read back (expired documents expire on access), the
   streaming query is stopped and run to the end (availableNow), and the mirror is compared
   with the store on every column, as ``demo.py`` does. The verdict requires mirror == store,
   read-back == store, and a failover that promoted a replica for every vbucket the victim led.

Every process started is stopped at the end (by pid, through ``NodeProcess``/``EtcdServer``),
also on an error, Ctrl-C or SIGTERM; the data, logs and tables stay in the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from changefeed import limits
from changefeed.cli.cluster import (
    admin_credentials,
    node_record,
    run,
    start_nodes,
    stat,
    stop_nodes,
    wait_until_up,
    write_record,
)
from changefeed.cli.demo import (
    DIFF_EXAMPLES_MAX,
    EXPIRY_S,
    LoadReport,
    MirrorCheck,
    _checked_columns,
    _one_op,
    check_mirror,
    check_read_back,
    read_back,
    read_store,
    run_mirror,
)
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import GetResult, KvClient
from changefeed.consumer.current_state import Document
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.errors import KeyNotFoundError, NotMyVbucketError
from changefeed.protocol.kv import MutationResult
from changefeed.vbmap import ClusterMap

NODES = 3
CLUSTER_NAME = "demo"
VBUCKETS_DEFAULT = 4  # 3 nodes: one leads ceil(4/3) = 2 of 4, exactly half
FAILOVER_TIMEOUT_S_DEFAULT = 3  # the node's default lease; 2 is the least etcd allows
# Shares of the workload loaded: before the query starts (its schema is inferred from the
# documents there: started on an empty bucket it would mirror raw values, and its restart,
# inferring JSON fields then, would need mergeSchema), before the query restart, before the kill.
QUERY_AT = 0.2
RESTART_AT = 0.4
KILL_AT = 0.5  # share of the workload loaded before the kill
TRIGGER_S = 1.0  # the streaming query's processingTime trigger
BATCHES_BEFORE_RESTART = 2  # micro-batches with rows before the query is restarted
QUERY_WAIT_S = 120.0  # a query's micro-batches on a loaded machine
IN_SYNC_WAIT_S = 30.0
PROMOTION_WAIT_S = 60.0  # lease + a new orchestrator's wait + promotion, on a loaded machine
REJOIN_WAIT_S = 120.0
POLL_S = 0.05
START_TIMEOUT_S = 120.0


class DemoFailedError(click.ClickException):
    """The verdict was negative: printed (or in the JSON), exit 1."""


# -- the cluster --------------------------------------------------------------------------------


@dataclass
class ClusterDemo:
    """etcd and three nodes under ``root``, as ``changefeed cluster start`` lays them out
    (``root/cluster.json``, ``root/etcd``, ``root/nodeN``)."""

    root: Path
    vbuckets: int
    replicas: int
    failover_timeout_s: int
    etcd: EtcdServer | None = None
    nodes: list[NodeProcess] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        assert self.etcd is not None
        return self.etcd.endpoint

    def start(self) -> ClusterMap:
        """Start etcd and the nodes; return the first map once every node serves.

        Raises:
            click.ClickException: etcd or a node did not start (naming it and its log).
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        self.etcd = EtcdServer(self.root / "etcd", name=f"changefeed-{CLUSTER_NAME}")
        try:
            self.etcd.start(timeout_s=limits.ETCD_START_TIMEOUT_S)
        except (RuntimeError, FileNotFoundError) as error:
            raise click.ClickException(str(error).splitlines()[0]) from None
        record: dict[str, Any] = {
            "cluster": CLUSTER_NAME, "etcd": self.endpoint, "etcd_pid": self.etcd.pid,
            "etcd_data_dir": str(self.etcd.data_dir), "etcd_client_port": self.etcd.client_port,
            "etcd_peer_port": self.etcd.peer_port, "vbuckets": self.vbuckets,
            "replicas": self.replicas, "nodes": [], "started_at": time.time(),
        }  # fmt: skip
        write_record(self.root, record)  # `cluster stop --dir` finds etcd if we die here
        for i in range(NODES):
            name = f"node{i}"
            self.nodes.append(
                NodeProcess(
                    self.root / name,
                    vbuckets=self.vbuckets,
                    args=[
                        *("--etcd", self.endpoint, "--cluster", CLUSTER_NAME, "--node-name", name),
                        *("--expected-nodes", str(NODES), "--replicas", str(self.replicas)),
                        *("--failover-timeout-s", str(self.failover_timeout_s)),
                        "--no-durable",  # as the single-node demo: processes die, not machines
                    ],
                    ready_timeout_s=max(1.0, deadline - time.monotonic()),
                )
            )
        start_nodes(self.nodes)
        self.record_nodes()
        return run(wait_until_up(self.endpoint, CLUSTER_NAME, self.nodes, deadline))

    def record_nodes(self) -> None:
        """Write the nodes' pids to cluster.json (after each start): ``changefeed cluster stop
        --dir`` stops them by pid if this process dies before it can."""
        record = json.loads((self.root / "cluster.json").read_text())
        record["nodes"] = [node_record(node) for node in self.nodes if node.process is not None]
        write_record(self.root, record)

    def node(self, name: str) -> NodeProcess:
        return next(node for node in self.nodes if node.root.name == name)

    def stop(self) -> None:
        """Stop the nodes (SIGTERM, SIGKILL if one hangs), then etcd; never raises."""
        stop_nodes(self.nodes)
        if self.etcd is not None:
            self.etcd.stop()
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((self.root / "cluster.json").read_text())
            record["stopped_at"] = time.time()
            write_record(self.root, record)


def most_actives(cluster_map: ClusterMap) -> tuple[str, list[int]]:
    """The node active for the most vbuckets (the first by name on a tie) and those vbuckets."""
    led: dict[str, list[int]] = {node.name: [] for node in cluster_map.nodes}
    for vb in range(cluster_map.vbuckets):
        active = cluster_map.active(vb)
        if active is not None:
            led[active.name].append(vb)
    name = max(sorted(led), key=lambda n: len(led[n]))
    return name, led[name]


# -- the failover -------------------------------------------------------------------------------


@dataclass
class FailoverReport:
    """What happened to the victim, from the kill to its rejoin. Times in seconds from the kill."""

    victim: str
    address: str
    led: list[int]
    vbuckets: int
    was_orchestrator: bool
    map_rev_before: int
    killed_at_op: int = 0
    killed_at: float = 0.0  # time.time()
    killed_monotonic: float = 0.0
    promoted_after_s: float | None = None
    promoted: dict[int, str] = field(default_factory=dict)  # vb -> its new active
    map_rev_after: int | None = None
    first_write_served_after_s: float | None = None  # a write to a led vb, after the kill
    lost_writes: int = 0  # acknowledged by the victim, not in the store after the failover
    lost_elsewhere: list[str] = field(default_factory=list)  # on vbuckets that did not move
    removes_of_lost_keys: int = 0
    rejoined_after_s: float | None = None  # from its restart until its copies caught up
    rejoin_rollbacks: int = 0
    rejoin_full_rebuilds: int = 0

    @property
    def happened(self) -> bool:
        return self.promoted_after_s is not None and sorted(self.promoted) == self.led


async def wait_in_sync_published(endpoint: str, timeout_s: float = IN_SYNC_WAIT_S) -> None:
    """Until every vbucket's active has published an in-sync set holding all its replicas.

    Raises:
        click.ClickException: not so within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    async with await ClusterMetadata.connect(endpoint, CLUSTER_NAME) as md:
        while True:  # bounded by timeout_s
            missing = await md.vbuckets_not_fully_in_sync()
            if missing == []:
                return
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"in-sync sets not published within {timeout_s:g} s: a failover would be "
                    "refused"
                )
            await asyncio.sleep(POLL_S)


async def watch_promotion(endpoint: str, report: FailoverReport) -> None:
    """Poll etcd's map until every vbucket the victim led has another active; note when."""
    deadline = report.killed_monotonic + PROMOTION_WAIT_S
    async with await ClusterMetadata.connect(endpoint, CLUSTER_NAME) as md:
        while time.monotonic() < deadline:
            stored = await md.read_map()
            if stored is not None:
                cmap = stored[0]
                moved = {vb: a.name for vb in report.led if (a := cmap.active(vb)) is not None}
                if sorted(moved) == report.led and report.victim not in moved.values():
                    report.promoted_after_s = time.monotonic() - report.killed_monotonic
                    report.promoted, report.map_rev_after = moved, cmap.rev
                    return
            await asyncio.sleep(POLL_S)


# -- the workload -------------------------------------------------------------------------------


class RecordingKvClient(KvClient):
    """A ``KvClient`` that remembers each key's last acknowledged write (value, or None for a
    removal) and the first write acknowledged on a vbucket of ``watched`` after ``since``: the
    loader's view, compared with the store once the failover has lost what it lost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acked: dict[bytes, bytes | None] = {}
        self.expiring: set[bytes] = set()
        self.watched: set[int] = set()
        self.since: float | None = None
        self.first_served: float | None = None
        self.route_retries = 0  # writes tried again after the client's own retries ran out

    def _served(self, key: bytes) -> None:
        if (
            self.since is not None
            and self.first_served is None
            and self.vbucket_of(key) in self.watched
        ):
            self.first_served = time.monotonic() - self.since

    async def _through_failover(
        self, write: Callable[[], Awaitable[MutationResult]]
    ) -> MutationResult:
        """``write()``, again while it fails for want of an active: the client follows the map
        for ``ROUTE_RETRY_S`` (15 s), and on a loaded machine a failover whose victim is also
        the orchestrator (lease + the new orchestrator's wait of one lease) can take longer.
        The writes are idempotent (an upsert, or a removal whose absence is fine)."""
        deadline = time.monotonic() + PROMOTION_WAIT_S
        while True:  # bounded by PROMOTION_WAIT_S
            try:
                return await write()
            except (OSError, NotMyVbucketError):  # OSError: refused, reset, timed out
                if time.monotonic() > deadline:
                    raise
                self.route_retries += 1
                await asyncio.sleep(POLL_S)

    async def upsert(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        result = await self._through_failover(
            lambda: super(RecordingKvClient, self).upsert(key, value, durability=durability, **meta)
        )
        self.acked[key] = value
        if meta.get("expiry"):
            self.expiring.add(key)
        self._served(key)
        return result

    async def remove(
        self, key: bytes, *, cas: int = 0, durability: Durability = "none"
    ) -> MutationResult:
        try:
            result = await self._through_failover(
                lambda: super(RecordingKvClient, self).remove(key, cas=cas, durability=durability)
            )
        except KeyNotFoundError:
            self.acked[key] = None  # absent either way (its insert was lost in the failover)
            raise
        self.acked[key] = None
        self._served(key)
        return result


@dataclass(frozen=True, slots=True)
class OneByOne:
    """The workload's writes (`demo.Writes`) each answered before the next: a write is
    followed through the failover and its ack recorded (`RecordingKvClient`)."""

    kv: KvClient

    async def set(self, key: bytes, value: bytes, *, expiry: int = 0) -> None:
        await self.kv.upsert(key, value, expiry=expiry)

    async def delete(self, key: bytes) -> None:
        await self.kv.remove(key)


@dataclass
class Loader:
    """The single-node demo's workload (``demo._one_op``), in slices, through the map."""

    items: int
    seed: int
    report: LoadReport = field(default_factory=LoadReport)
    rng: random.Random = field(init=False)
    live: list[bytes] = field(default_factory=list)
    acked: dict[bytes, bytes | None] = field(default_factory=dict)
    expiring: set[bytes] = field(default_factory=set)
    removes_not_found: int = 0
    route_retries: int = 0  # writes tried again once KvClient's own 15 s of retries ran out

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def run(
        self,
        port: int,
        first: int,
        stop: int,
        console: Console,
        *,
        before: Callable[[RecordingKvClient, int], Any] | None = None,
    ) -> RecordingKvClient:
        """Ops ``first`` to ``stop``; ``before(kv, i)`` is awaited before each op if given."""
        user, password = admin_credentials()  # CHANGEFEED_PASSWORD, as the nodes have it
        kv = await RecordingKvClient.connect(HOST, port, user=user, password=password)
        assert isinstance(kv, RecordingKvClient)  # connect builds ``cls``
        started = time.perf_counter()
        try:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("loading", total=stop - first)
                for i in range(first, stop):
                    if before is not None:
                        await before(kv, i)
                    try:
                        await _one_op(OneByOne(kv), self.rng, self.live, self.report, i)
                    except KeyNotFoundError:
                        self.removes_not_found += 1  # a removal of a key the failover lost
                    if i % 200 == 0:
                        progress.update(task, completed=i - first)
        finally:
            await kv.close()
            self.acked.update(kv.acked)
            self.expiring |= kv.expiring
            self.route_retries += kv.route_retries
            self.report.ops += stop - first
            self.report.seconds += time.perf_counter() - started
        return kv


def lost_writes(
    loader: Loader, store: dict[bytes, Document], moved: set[int], vbuckets: int
) -> tuple[int, list[str]]:
    """Acknowledged writes the store does not hold: (count on vbuckets that failed over,
    descriptions of those elsewhere, which must not exist). Expiring keys are left out."""
    from changefeed.vbmap import vbucket_for_key

    lost, elsewhere = 0, []
    for key, value in loader.acked.items():
        if key in loader.expiring:
            continue
        doc = store.get(key)
        held = None if doc is None or doc.deleted else doc.value
        if held == value:
            continue
        vb = vbucket_for_key(key, vbuckets)
        if vb in moved:
            lost += 1
        else:
            elsewhere.append(f"{key!r} (vb {vb}): acknowledged {value!r}, store {held!r}")
    return lost, elsewhere


# -- the pipeline -------------------------------------------------------------------------------


def start_query(spark: Any, options: dict[str, str], tables: Path, checkpoint: Path) -> Any:
    """The streaming mirror with a processingTime trigger (it runs while the load does)."""
    from changefeed.spark import MirrorWriter

    df = spark.readStream.format("changefeed").options(**options).load()
    return (
        df.writeStream.foreachBatch(MirrorWriter(tables, options))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{TRIGGER_S} seconds")
        .start()
    )


def check_query(query: Any) -> None:
    """Raise when the query has stopped with an error (a failover it could not follow)."""
    if not query.isActive and query.exception() is not None:
        raise click.ClickException(f"the streaming mirror failed: {query.exception()}")


def wait_batches(query: Any, count: int) -> None:
    """Until the query has run ``count`` micro-batches with rows."""
    deadline = time.monotonic() + QUERY_WAIT_S
    while len([p for p in query.recentProgress if p.get("numInputRows")]) < count:
        check_query(query)
        if time.monotonic() > deadline:
            raise click.ClickException(f"the mirror ran no {count} micro-batches with rows")
        time.sleep(0.1)


def stop_query(query: Any) -> list[dict[str, Any]]:
    """Stop between micro-batches (a quieter stop, same guarantees); return its progress."""
    deadline = time.monotonic() + 10
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.01)
    query.stop()
    check_query(query)
    return [dict(p) for p in query.recentProgress]


def changelog_rows(tables: Path) -> tuple[int, list[dict[str, int]]]:
    """The changelog's change rows (every micro-batch ever committed: the queries' progress
    lists keep only the recent ones) and its rollback rows, (vbucket, seqno) rolled back to."""
    from deltalake import DeltaTable

    log = DeltaTable(str(tables / "changelog")).to_pyarrow_table(columns=["vbucket", "seqno", "op"])
    rollbacks = [
        {"vbucket": row["vbucket"], "seqno": row["seqno"]}
        for row in log.to_pylist()
        if row["op"] == "rollback"
    ]
    return log.num_rows - len(rollbacks), rollbacks


# -- the run ------------------------------------------------------------------------------------


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so the ``finally`` that stops every process runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cluster_demo(
    *,
    items: int,
    vbuckets: int,
    replicas: int,
    failover_timeout_s: int,
    batch_rows: int,
    data_dir: Path | None,
    seed: int,
    as_json: bool,
) -> None:
    """The command's body: everything stopped on the way out, whatever happens."""
    console = Console(stderr=as_json)
    root = (data_dir or Path(tempfile.mkdtemp(prefix="changefeed-demo-cluster-"))).resolve()
    if data_dir is not None and data_dir.exists() and any(data_dir.iterdir()):
        raise click.ClickException(f"{data_dir} is not empty; the demo needs a fresh directory")
    root.mkdir(parents=True, exist_ok=True)
    cluster = ClusterDemo(root, vbuckets, replicas, failover_timeout_s)
    sessions: list[Any] = []  # the Spark session, once built: its queries are stopped too
    with sigterm_as_interrupt():
        try:
            summary = _demo(console, cluster, items, batch_rows, seed, sessions.append)
        finally:
            for spark in sessions:
                for query in spark.streams.active:
                    with contextlib.suppress(Exception):  # py4j errors: the JVM may be gone
                        query.stop()
            cluster.stop()  # the data and tables stay for you to query
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        _print_report(console, summary)
    if not summary["ok"]:
        raise DemoFailedError("; ".join(summary["problems"]))


def _demo(
    console: Console,
    cluster: ClusterDemo,
    items: int,
    batch_rows: int,
    seed: int,
    keep_spark: Callable[[Any], None],
) -> dict[str, Any]:
    first_map = cluster.start()
    victim_name, led = most_actives(first_map)
    victim = cluster.node(victim_name)
    survivors = [n for n in cluster.nodes if n is not victim]
    port = survivors[0].port  # bootstraps the loader and the reads; never the victim
    leader = run(_leader(cluster.endpoint))
    failover = FailoverReport(
        victim=victim_name, address=victim.address, led=led, vbuckets=cluster.vbuckets,
        was_orchestrator=leader == victim_name, map_rev_before=first_map.rev,
    )  # fmt: skip
    console.print(
        f"[bold]cluster[/] etcd {cluster.endpoint}, {NODES} nodes, {cluster.replicas} "
        f"replica(s), {cluster.vbuckets} vbuckets, lease {cluster.failover_timeout_s} s; "
        f"data in {cluster.root} (changefeed cluster status --dir {cluster.root})"
    )
    console.print(
        f"[bold]victim[/] {victim_name} ({victim.address}) leads {len(led)} of "
        f"{cluster.vbuckets} vbuckets {led}"
        + (" and is the orchestrator" if failover.was_orchestrator else "")
    )

    from changefeed.spark.session import local_session

    spark = local_session("changefeed-demo-cluster")
    keep_spark(spark)
    # The victim is the last seed: the mirror's re-read of rolled-back keys dials the first.
    seeds = ",".join(node.address for node in [*survivors, victim])
    options = {"cluster": seeds, "maxOffsetsPerTrigger": str(batch_rows),
               "failOnDataLoss": "false"}  # fmt: skip
    tables, checkpoint = cluster.root / "tables", cluster.root / "checkpoint"
    loader = Loader(items, seed)
    query_at, restart_at = int(items * QUERY_AT), int(items * RESTART_AT)
    kill_at = int(items * KILL_AT)
    started = time.perf_counter()
    asyncio.run(loader.run(port, 0, query_at, console))
    query = start_query(spark, options, tables, checkpoint)
    asyncio.run(loader.run(port, query_at, restart_at, console))
    wait_batches(query, BATCHES_BEFORE_RESTART)
    progress = stop_query(query)
    console.print(f"[bold]query[/] stopped after {len(progress)} micro-batches; restarting")
    query = start_query(spark, options, tables, checkpoint)
    asyncio.run(wait_in_sync_published(cluster.endpoint))

    async def second_half() -> None:
        watcher: asyncio.Task[None] | None = None

        async def kill_midway(kv: RecordingKvClient, i: int) -> None:
            nonlocal watcher
            if i != kill_at:
                return
            victim.kill()
            failover.killed_monotonic, failover.killed_at = time.monotonic(), time.time()
            failover.killed_at_op = i
            kv.watched, kv.since = set(led), failover.killed_monotonic
            watcher = asyncio.create_task(watch_promotion(cluster.endpoint, failover))
            console.print(f"[bold red]SIGKILL[/] {victim_name} (pid {victim.pid}) at op {i:,}")

        try:
            kv = await loader.run(port, restart_at, items, console, before=kill_midway)
            failover.first_write_served_after_s = kv.first_served
        finally:
            if watcher is not None:
                await watcher

    asyncio.run(second_half())
    if not failover.happened:
        raise click.ClickException(
            f"{victim_name} was not failed over within {PROMOTION_WAIT_S:g} s of the kill "
            f"(see {cluster.root}/node*/node.log)"
        )
    console.print(
        f"[bold]failover[/] {failover.promoted_after_s:.2f} s after the kill: "
        + ", ".join(f"vb {vb} → {name}" for vb, name in sorted(failover.promoted.items()))
    )
    check_query(query)

    rejoin_started = time.monotonic()
    victim.start()
    cluster.record_nodes()
    rollbacks, rebuilds = asyncio.run(wait_rejoined(cluster, victim))
    failover.rejoined_after_s = time.monotonic() - rejoin_started
    failover.rejoin_rollbacks, failover.rejoin_full_rebuilds = rollbacks, rebuilds
    console.print(f"[bold]rejoin[/] {victim_name} caught up {failover.rejoined_after_s:.1f} s "
                  f"after its restart ({rollbacks} replica-stream rollbacks)")  # fmt: skip

    time.sleep(max(0.0, EXPIRY_S + 0.5 - (time.perf_counter() - started)))
    read = asyncio.run(read_back(port, loader.report.keys))  # expired documents expire on access
    progress += stop_query(query)
    progress += run_mirror(spark, options, tables, checkpoint)  # to the end, availableNow
    elapsed = time.perf_counter() - started
    store = asyncio.run(read_store(port, cluster.vbuckets))  # nothing writes any more
    failover.lost_writes, failover.lost_elsewhere = lost_writes(
        loader, store, set(led), cluster.vbuckets
    )
    failover.removes_of_lost_keys = loader.removes_not_found
    return _summary(cluster, failover, loader, read, store, tables, progress, elapsed)


async def _leader(endpoint: str) -> str | None:
    async with await ClusterMetadata.connect(endpoint, CLUSTER_NAME) as md:
        found = await md.leader()
    return None if found is None else found[0]


async def wait_rejoined(cluster: ClusterDemo, node: NodeProcess) -> tuple[int, int]:
    """Until every replica copy's high seqno equals its active's (the restarted node caught up);
    returns the node's replica-stream (rollbacks, full rebuilds) from STAT replica-feeds.

    Raises:
        click.ClickException: not caught up within REJOIN_WAIT_S.
    """
    deadline = time.monotonic() + REJOIN_WAIT_S
    behind: list[tuple[int, str]] = []
    while time.monotonic() < deadline:
        async with await ClusterMetadata.connect(cluster.endpoint, CLUSTER_NAME) as md:
            stored = await md.read_map()
        assert stored is not None, "the map vanished"
        cmap = stored[0]
        highs: dict[str, dict[int, int]] = {}
        for member in cluster.nodes:
            found = await stat(HOST, member.port, "vbucket-seqno", 5.0)
            highs[member.root.name] = {
                int(k[3:].split(":")[0]): int(v)
                for k, v in found.items()
                if k.endswith(":high_seqno")
            }
        behind = []
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            assert active is not None, vb
            for replica in cmap.replica_nodes(vb):
                if highs[replica.name].get(vb) != highs[active.name].get(vb):
                    behind.append((vb, replica.name))
        if not behind:
            feeds = await stat(HOST, node.port, "replica-feeds", 5.0)
            total = {
                counter: sum(int(v) for k, v in feeds.items() if k.endswith(f":{counter}"))
                for counter in ("rollbacks", "full_rebuilds")
            }
            return total["rollbacks"], total["full_rebuilds"]
        await asyncio.sleep(0.1)
    raise click.ClickException(f"replicas not caught up within {REJOIN_WAIT_S:g} s: {behind[:8]}")


def _summary(
    cluster: ClusterDemo,
    failover: FailoverReport,
    loader: Loader,
    read: dict[bytes, GetResult],
    store: dict[bytes, Document],
    tables: Path,
    progress: list[dict[str, Any]],
    elapsed: float,
) -> dict[str, Any]:
    """The verdict and every figure of the report, JSON-able."""
    from changefeed.spark import read_mirror

    problems: list[str] = []
    read_problems = check_read_back(read, store)
    if read_problems:
        problems.append(f"KV read-back != store (DCP): {len(read_problems)} keys differ")
    mirror_table = read_mirror(tables)
    check = check_mirror(mirror_table, store)
    if not check.ok:
        problems.append(f"mirror != store: {check.summary()}")
    if not failover.happened:
        problems.append("no failover")
    if failover.lost_elsewhere:
        problems.append(
            f"{len(failover.lost_elsewhere)} acknowledged writes missing on vbuckets that did "
            "not fail over"
        )
    rows, rollbacks = changelog_rows(tables)
    details = dataclasses.asdict(failover)
    details.pop("killed_monotonic")
    details["promoted"] = {str(vb): name for vb, name in sorted(failover.promoted.items())}
    return {
        "ok": not problems,
        "verdict": "mirror == store" if not problems else "FAILED",
        "problems": problems,
        "cluster": {
            "dir": str(cluster.root), "etcd": cluster.endpoint, "nodes": NODES,
            "replicas": cluster.replicas, "vbuckets": cluster.vbuckets,
            "failover_timeout_s": cluster.failover_timeout_s,
        },
        "failover": details,
        "load": {
            "ops": loader.report.ops, "seconds": round(loader.report.seconds, 3),
            "expiring": len(loader.report.expiring), "keys": len(loader.report.keys),
            "writes_retried_after_the_client_gave_up": loader.route_retries,
        },
        "pipeline": {
            "rows": rows, "micro_batches": len(progress), "query_restarts": 1,
            "seconds": round(elapsed, 3), "rollbacks": rollbacks,
            "batches": [
                {"batch": p.get("batchId"), "rows": int(p.get("numInputRows", 0)),
                 "ms": (p.get("durationMs") or {}).get("triggerExecution")}
                for p in progress
            ],
        },
        "check": {
            "columns": ["key", *_checked_columns(mirror_table.column_names), "deletion"],
            "live": check.live, "deleted": check.deleted, "missing": len(check.missing),
            "undeleted": len(check.undeleted), "unknown": len(check.unknown),
            "differ": len(check.differ), "read_back_problems": read_problems[:DIFF_EXAMPLES_MAX],
            "examples": _examples(check),
        },
        "tables": {"changelog": str(tables / "changelog"), "mirror": str(tables / "mirror")},
    }  # fmt: skip


def _examples(check: MirrorCheck) -> dict[str, list[str]]:
    shown = DIFF_EXAMPLES_MAX
    return {
        "missing": [k.decode("utf-8", "replace") for k in check.missing[:shown]],
        "undeleted": [k.decode("utf-8", "replace") for k in check.undeleted[:shown]],
        "unknown": [k.decode("utf-8", "replace") for k in check.unknown[:shown]],
        "differ": [
            f"{k.decode('utf-8', 'replace')}: {', '.join(c for c, _, _ in d)}"
            for k, d in sorted(check.differ.items())[:shown]
        ],
    }


def _print_report(console: Console, summary: dict[str, Any]) -> None:
    f, load, pipe = summary["failover"], summary["load"], summary["pipeline"]
    c, check = summary["cluster"], summary["check"]
    table = Table(title="changefeed demo --cluster — 3 nodes → DCP → Spark → Delta, one killed")
    table.add_column("what")
    table.add_column("result")
    table.add_row(
        "cluster",
        f"{c['nodes']} nodes + etcd, {c['replicas']} replica(s), {c['vbuckets']} vbuckets, "
        f"lease {c['failover_timeout_s']} s",
    )
    share = len(f["led"]) / max(1, f["vbuckets"])
    table.add_row(
        "killed (SIGKILL)",
        f"{f['victim']} at op {f['killed_at_op']:,}: active of {len(f['led'])} of "
        f"{f['vbuckets']} vbuckets ({share:.0%}) {f['led']}"
        + (", and the orchestrator" if f["was_orchestrator"] else ""),
    )
    promoted = ", ".join(f"vb {vb} → {name}" for vb, name in f["promoted"].items())
    killed = time.strftime("%H:%M:%S", time.localtime(f["killed_at"]))
    table.add_row(
        "failover (kill → promoted)",
        f"killed {killed}.{int(f['killed_at'] * 1000) % 1000:03d}, promoted "
        f"{_s(f['promoted_after_s'])} later: map rev {f['map_rev_before']} → "
        f"{f['map_rev_after']}, {promoted}",
    )
    table.add_row(
        "kill → first write served on a moved vbucket", _s(f["first_write_served_after_s"])
    )
    table.add_row(
        "acknowledged writes lost (not replicated before the kill)",
        f"{f['lost_writes']} (removes that found their key gone: {f['removes_of_lost_keys']})",
    )
    table.add_row(
        "rejoin",
        f"caught up {_s(f['rejoined_after_s'])} after its restart; replica-stream rollbacks "
        f"{f['rejoin_rollbacks']}, full rebuilds {f['rejoin_full_rebuilds']}",
    )
    rollbacks = ", ".join(f"vb {r['vbucket']} to {r['seqno']}" for r in pipe["rollbacks"])
    seen = f": {rollbacks}" if rollbacks else " (none needed: the failover lost nothing it read)"
    table.add_row("pipeline rollbacks seen", f"{len(pipe['rollbacks'])}{seen}")
    table.add_row(
        "KV ops loaded",
        f"{load['ops']:,} ({load['ops'] / max(load['seconds'], 1e-9):,.0f} ops/s, through the "
        "failover)",
    )
    table.add_row(
        "change rows mirrored",
        f"{pipe['rows']:,} in the changelog; {pipe['micro_batches']} micro-batches seen, 1 query "
        "restart",
    )
    table.add_row("expired documents", f"{load['expiring']:,}")
    verified = (
        f"mirror == store on all columns ({', '.join(check['columns'])}): {check['live']:,} "
        f"live keys, {check['deleted']:,} deleted"
    )
    table.add_row("verdict", verified if summary["ok"] else "; ".join(summary["problems"]))
    table.add_row("tables", f"{summary['tables']['mirror']} (Delta)")
    console.print(table)
    if not summary["ok"]:
        for line in check["read_back_problems"]:
            console.print(escape(f"  {line}"))
        for kind, keys in check["examples"].items():
            if keys:
                console.print(escape(f"  {kind}: {', '.join(keys)}"))
        for line in f["lost_elsewhere"][:DIFF_EXAMPLES_MAX]:
            console.print(escape(f"  lost: {line}"))


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"
