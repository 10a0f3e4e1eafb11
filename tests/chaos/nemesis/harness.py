"""One chaos run end to end: a cluster with automatic failover, the loader, the streaming
consumer and (optionally) the Spark mirror running while the nemesis plays its schedule; then
healing, convergence, and the checker's report.

Phases:

1. start ``nodes`` nodes on one etcd (``support.cluster.start_cluster``, a short failover
   lease), wait until the actives have published their in-sync sets (before that a failover
   is refused, rightly);
2. chaos: the loader writes, the consumer streams, the mirror mirrors, the nemesis injects
   faults for ``duration_s``; then every node is healed and the loader writes on for
   ``settle_s`` on the healed cluster, and stops;
3. convergence: every replica catches up with its active (bounded; a copy that does not is
   reported as divergent, not waited on forever);
4. the truth: each vbucket's active streamed from the beginning (``support.consumer``), each
   node's copy of each vbucket it holds, the consumer's and the mirror's final states (each
   given time to catch up);
5. the checker (``checker``) turns all that into the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import KvClient
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.errors import DurabilityImpossibleError
from changefeed.vbmap import ClusterMap
from support.cluster import (
    cluster_map,
    copy_of,
    purge_seqnos,
    seqnos,
    start_cluster,
    wait_in_sync_published,
)
from support.consumer import server_state
from support.nodes import NodeFactory

from .checker import (
    ChaosReport,
    Copy,
    check_monotonic,
    check_replicas,
    check_state,
    check_writes,
)
from .consumer import ChaosConsumer
from .history import Version
from .loader import Loader
from .mirror import MirrorJob
from .schedule import Nemesis, Targets, describe, make_schedule

FAILOVER_TIMEOUT_S = 2  # lease seconds: kill to promotion (FAST in test_auto_failover.py)
CONVERGE_S = 90.0  # replicas catching up after healing
CONSUMER_CATCH_UP_S = 60.0
MIRROR_CATCH_UP_S = 180.0  # a loaded 2-core machine runs Spark micro-batches slowly
NEMESIS_JOIN_S = 60.0  # a step heals within its downtime plus a node's start-up
NODE_ARGS = ["--no-durable"]  # processes are killed, the machine is not: the page cache stays


def env_seed(default: int | None = None) -> int:
    """``CHANGEFEED_CHAOS_SEED`` to replay a run, else `default`, else a fresh seed (printed
    by the report)."""
    chosen = default if default is not None else random.randrange(2**32)
    return int(os.environ.get("CHANGEFEED_CHAOS_SEED", chosen))


def env_durability() -> Durability:
    level = os.environ.get("CHANGEFEED_CHAOS_DURABILITY", "majority")
    allowed = ("none", "majority", "majorityAndPersistActive", "persistToMajority")
    assert level in allowed, f"CHANGEFEED_CHAOS_DURABILITY={level!r}: one of {allowed}"
    return level  # type: ignore[return-value]


class DurabilityUnsupportedError(Exception):
    """The healthy cluster refuses writes at the configured durability level (a server
    without SyncWrites answers DURABILITY_IMPOSSIBLE): a run would acknowledge nothing."""


@dataclass
class ChaosConfig:
    seed: int
    durability: Durability
    duration_s: float
    targets: Targets
    nodes: int = 3
    replicas: int = 2
    vbuckets: int = 16
    mirror: bool = True
    settle_s: float = 5.0  # loader writes on the healed cluster before stopping
    workers: int = 0  # 0: 4 writers, 12 at a durable level (each write waits for replicas)
    keys: int = 400


@dataclass
class Run:
    """The live parts of a run, kept for the ``finally`` that stops them."""

    cluster: list[NodeProcess] = field(default_factory=list)
    nemesis: Nemesis | None = None
    playing: threading.Thread | None = None
    mirror: MirrorJob | None = None


async def newest_map(nodes: list[NodeProcess]) -> ClusterMap:
    """The map of the highest revision any live node serves."""
    found: list[ClusterMap] = []
    for node in nodes:
        if node.alive:
            try:
                found.append(await cluster_map(node))
            except (OSError, TimeoutError):
                continue
    assert found, "no node serves a map"
    return max(found, key=lambda m: m.rev)


async def probe_durability(node: NodeProcess, durability: Durability) -> str:
    """One write at ``durability`` on the healthy cluster: "" if acknowledged, the error if
    the node answered DURABILITY_IMPOSSIBLE (a server without SyncWrites). Anything else
    is raised: a healthy cluster must not time out or drop the connection."""
    async with await KvClient.connect(HOST, node.port) as kv:
        try:
            await kv.upsert(b"chaos-probe", b"probe", durability=durability)
        except DurabilityImpossibleError as error:
            return repr(error)
    return ""


def run_chaos(
    config: ChaosConfig, nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, workdir: Path
) -> ChaosReport:
    """Play one run and return its report (the caller asserts ``not report.failed``)."""
    run = Run()
    try:
        return _run(config, nodes, etcd, cluster_name, workdir, run)
    finally:
        if run.nemesis is not None:
            run.nemesis.stop()
            if run.playing is not None:
                run.playing.join(NEMESIS_JOIN_S)  # it heals the fault it is in, then returns
            run.nemesis.heal_all()  # frozen nodes would ignore the fixtures' SIGTERM
        if run.mirror is not None:
            run.mirror.stop()


def _run(
    config: ChaosConfig,
    nodes: NodeFactory,
    etcd: EtcdServer,
    cluster_name: str,
    workdir: Path,
    run: Run,
) -> ChaosReport:
    rng = random.Random(config.seed)
    steps = make_schedule(
        rng.randrange(2**32), nodes=config.nodes, duration_s=config.duration_s,
        targets=config.targets,
    )  # fmt: skip
    print(f"chaos seed {config.seed}: schedule {config.targets}: {describe(steps)}")
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=config.nodes, replicas=config.replicas,
        vbuckets=config.vbuckets, extra=NODE_ARGS, failover_timeout_s=FAILOVER_TIMEOUT_S,
    )  # fmt: skip
    run.cluster = cluster
    names = [f"n{i}" for i in range(1, config.nodes + 1)]
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))
    if config.durability != "none":
        refused = asyncio.run(probe_durability(cluster[0], config.durability))
        if refused:
            raise DurabilityUnsupportedError(
                f"the healthy cluster refused a durability={config.durability} write: {refused}"
            )
    report = ChaosReport(config.seed, config.targets, config.durability)
    if run.mirror is None and config.mirror:
        run.mirror = MirrorJob(
            [n.address for n in cluster], workdir / "tables", workdir / "mirror.log"
        ).start()

    clock = time.monotonic()
    seeds = [(HOST, n.port) for n in cluster]
    loader = Loader(
        seeds, durability=config.durability, rng=random.Random(rng.random()), clock=clock,
        workers=config.workers or (4 if config.durability == "none" else 12), keys=config.keys,
    )  # fmt: skip
    consumer = ChaosConsumer(seeds, config.vbuckets, random.Random(rng.random()))
    nemesis = run.nemesis = Nemesis(cluster, names, clock)
    truth: dict[bytes, Version] = {}

    async def chaos() -> None:
        writing = asyncio.create_task(loader.run())
        consuming = asyncio.create_task(consumer.run())
        playing = run.playing = threading.Thread(target=nemesis.run, args=(steps,), daemon=True)
        playing.start()
        try:
            while playing.is_alive():  # bounded by the schedule (each step is bounded)
                await asyncio.sleep(0.2)
            await asyncio.to_thread(nemesis.heal_all)
            report.healed_s = nemesis.now()
            await asyncio.sleep(config.settle_s)
        finally:
            nemesis.stop()
            loader.stop()
            await writing
        await converge(cluster)
        truth.update(await store_truth(cluster))
        await check_everything(report, truth, cluster, consumer, run.mirror)
        consumer.stop()
        await consuming

    asyncio.run(chaos())
    report.writes = loader.writes
    report.faults = nemesis.faults
    final = {key: None if v.deleted else v.value for key, v in truth.items()}
    report.write_check = check_writes(loader.writes, final)
    report.notes += [f"nemesis: {e}" for e in nemesis.errors]
    report.notes.append(
        f"loader: {loader.stats.connects} connects, errors {loader.stats.errors}; consumer: "
        f"{consumer.history.items} items, {consumer.history.rollbacks} rollbacks, "
        f"{consumer.history.disconnects} disconnects, {consumer.history.refusals} refused/ended, "
        f"{consumer.history.restarts} restarts"
    )
    report.notes += [f"loader: first {k}: {m}" for k, m in loader.stats.examples.items()]
    report.notes += [f"loader: last {k}: {m}" for k, m in loader.stats.last.items()]
    report.notes += [f"consumer: {e}" for e in consumer.errors[:5]]
    for name, node in zip(names, cluster, strict=True):
        errors = node.errors_in_log()
        if errors:
            report.notes.append(f"{name} log has {len(errors)} error lines, e.g. {errors[:2]}")
    return report


async def converge(cluster: list[NodeProcess]) -> None:
    """Wait (bounded) until every replica copy's high seqno equals its active's under the
    newest map; a copy still behind after ``CONVERGE_S`` is left for check 2 to report."""
    deadline = time.monotonic() + CONVERGE_S
    while time.monotonic() < deadline:
        cmap = await newest_map(cluster)
        highs = {}
        for node in cluster:
            with contextlib.suppress(OSError, TimeoutError):
                highs[node.port] = await seqnos(node)
        behind = False
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            if active is None:
                behind = True
                break
            want = highs.get(active.port, {}).get(vb, (-2, -2))[0]
            for replica in cmap.replica_nodes(vb):
                if highs.get(replica.port, {}).get(vb, (-1, -1))[0] != want:
                    behind = True
        if not behind:
            return
        await asyncio.sleep(0.5)


async def store_truth(cluster: list[NodeProcess]) -> dict[bytes, Version]:
    """The store's final state: each vbucket streamed from its active, from the beginning."""
    state = await server_state(next(n for n in cluster if n.alive))
    return {
        key: Version(c.seqno, c.value, c.cas, c.rev_seqno, c.deleted)
        for key, c in state.latest().items()
    }


async def check_everything(
    report: ChaosReport,
    truth: dict[bytes, Version],
    cluster: list[NodeProcess],
    consumer: ChaosConsumer,
    mirror: MirrorJob | None,
) -> None:
    """Checks 2-4 (check 1 needs the loader's history, complete only once it stopped)."""
    report.replica_problems = await replica_check(cluster)
    report.monotonic_problems = check_monotonic(consumer.history.timeline)

    deadline = time.monotonic() + CONSUMER_CATCH_UP_S
    while True:  # bounded by the deadline
        report.consumer = check_state(truth, consumer.history.state())
        if not (report.consumer.missing or report.consumer.stale):
            break
        if time.monotonic() > deadline:
            report.notes.append(f"consumer did not converge in {CONSUMER_CATCH_UP_S} s")
            break
        await asyncio.sleep(0.5)
    if mirror is None:
        return
    deadline = time.monotonic() + MIRROR_CATCH_UP_S
    while True:  # bounded by the deadline
        try:
            state = await asyncio.to_thread(mirror.state)
        except Exception as error:  # a commit under way: read again
            report.notes.append(f"mirror read: {error!r}")
            state = None
        report.mirror = check_state(truth, state or {})
        if state is not None and not (report.mirror.missing or report.mirror.stale):
            break
        if not mirror.running:
            report.notes.append(f"mirror job exited: {mirror.log_tail(1500)}")
            break
        if time.monotonic() > deadline:
            report.notes.append(f"mirror did not converge in {MIRROR_CATCH_UP_S} s")
            break
        await asyncio.sleep(1.0)


async def replica_check(cluster: list[NodeProcess]) -> list[str]:
    """Check 2: every node's copy of every vbucket it holds under the newest map, against the
    active's (one DCP client per node over all its vbuckets)."""
    cmap = await newest_map(cluster)
    by_port = {n.port: n for n in cluster}
    held: dict[int, list[int]] = {}
    for vb in range(cmap.vbuckets):
        for holder in [cmap.active(vb), *cmap.replica_nodes(vb)]:
            if holder is not None:
                held.setdefault(holder.port, []).append(vb)
    copies: dict[int, dict[int, Copy]] = {}  # vb -> port -> copy
    unreadable: list[str] = []
    for port, vbs in held.items():
        node = by_port[port]
        try:
            changes = await copy_of(node, vbs)
            highs = await seqnos(node)
            purged = await purge_seqnos(node)
        except (OSError, TimeoutError, AssertionError) as error:
            unreadable.append(f"{node.root.name}: its copies could not be read: {error!r}")
            continue
        for vb in vbs:
            copies.setdefault(vb, {})[port] = Copy(
                node.root.name, changes[vb], highs[vb][0], purged[vb]
            )
    pairs: dict[int, tuple[Copy, list[Copy]]] = {}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        if active is None or active.port not in copies.get(vb, {}):
            unreadable.append(f"vb {vb}: no readable active in map rev {cmap.rev}")
            continue
        found = copies[vb]
        pairs[vb] = (
            found[active.port],
            [found[r.port] for r in cmap.replica_nodes(vb) if r.port in found],
        )
    return unreadable + check_replicas(pairs)
