"""One chaos run on test hosts end to end (``network.HostNemesis`` playing a seeded schedule of
network, process and etcd faults on a ``support.hosts.HostCluster``), judged by the same
checker as the loopback runs (``harness``), plus the official SDK's CAS updates.

While the nemesis plays, from the client host (``HostCluster.run``: a thread inside the client
namespace): the ``Loader`` writes through ``KvClient`` at the durability level (each key owned
by one worker, versions 1, 2, 3...), the ``ChaosConsumer`` streams every vbucket following
the map, and, when ``sdk`` is on, ``tests/hosts/sdk_writer.py`` (the official SDK, durability
MAJORITY, fresh upserts and CAS read-modify-writes of hot keys shared by every worker) runs as
a process there. Optionally the Spark mirror runs there too (``mirror``; the JVM is heavy on
this 2-core machine, so only the long runs ask for it).

Then: every fault healed, the loader and the SDK writer write on for ``settle_s`` and stop,
the cluster converges (``HostCluster.wait_converged``; a copy still behind is reported as
divergent, not waited on forever), the truth is each vbucket streamed from its active from the
beginning, and the checks are the loopback ones (acknowledged durable writes, phantoms,
replica copies against their active, the consumer's order and final state, the mirror's) plus
the SDK writer's (``hosts.workload.check``: lost fresh writes, lost CAS updates, phantoms,
CAS metadata), as extra counts of the report.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from changefeed.consumer import KvClient
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.errors import DurabilityImpossibleError
from hosts.workload import SdkWriter
from hosts.workload import check as check_sdk
from support.cluster import wait_in_sync_published
from support.consumer import stream_to_latest
from support.hosts import NODE_PORT, HostCluster, copy_of, purge_seqnos, seqnos

from .checker import ChaosReport, Copy, check_monotonic, check_replicas, check_state, check_writes
from .consumer import ChaosConsumer
from .harness import CONSUMER_CATCH_UP_S, MIRROR_CATCH_UP_S, DurabilityUnsupportedError
from .history import Version
from .loader import DURABLE_LEVELS, Loader
from .mirror import MirrorJob
from .network import (
    DOWN_S,
    GAP_S,
    HostNemesis,
    HostStep,
    describe_host,
    make_host_schedule,
)

CONVERGE_S = 90.0  # a replica feed silent for 15 s reconnects: healing may take that long
NEMESIS_JOIN_S = 90.0  # a step heals within its downtime plus a node's or member's start-up


@dataclass
class HostChaosConfig:
    seed: int
    durability: Durability
    duration_s: float
    kinds: tuple[str, ...]
    down_s: tuple[float, float] = DOWN_S
    gap_s: tuple[float, float] = GAP_S
    sdk: bool = True  # the official SDK's CAS read-modify-writes too
    mirror: bool = False
    settle_s: float = 3.0
    workers: int = 0  # 0: 4 writers, 8 at a durable level
    keys: int = 400
    sdk_workers: int = 2


class HostMirrorJob(MirrorJob):
    """The mirror job as a process on the client host (Spark's driver bound to loopback: the
    machine's own name has no address inside the namespace)."""

    def __init__(self, cluster: HostCluster, tables: Path, log: Path) -> None:
        super().__init__([f"{n.host}:{NODE_PORT}" for n in cluster.nodes], tables, log)
        self.command = cluster.client_command(*self.command)

    def start(self) -> HostMirrorJob:
        with open(self.log, "ab") as handle:
            self.process = subprocess.Popen(
                self.command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
            )  # fmt: skip
        return self


def schedule_for(config: HostChaosConfig, cluster: HostCluster) -> list[HostStep]:
    return schedule(config, cluster.node_count, len(cluster.etcd))


def schedule(config: HostChaosConfig, nodes: int, members: int) -> list[HostStep]:
    """The run's schedule, from its seed alone."""
    rng = random.Random(config.seed)
    return make_host_schedule(
        rng.randrange(2**32), nodes=nodes, members=members,
        duration_s=config.duration_s, kinds=config.kinds, down_s=config.down_s,
        gap_s=config.gap_s,
    )  # fmt: skip


def run_host_chaos(
    config: HostChaosConfig, cluster: HostCluster, workdir: Path, replay: str
) -> ChaosReport:
    """Play one run on a started ``cluster``; returns the report (the caller asserts
    ``not report.failed``). Every fault is healed and every job stopped on the way out."""
    steps = schedule_for(config, cluster)
    print(f"chaos seed {config.seed} on test hosts: {describe_host(steps)}")
    cluster.run(wait_in_sync_published(cluster.etcd[0].endpoint, cluster.cluster))
    if config.durability != "none":
        refused = cluster.run(probe(cluster, config.durability))
        if refused:
            raise DurabilityUnsupportedError(
                f"the healthy cluster refused a durability={config.durability} write: {refused}"
            )
    report = ChaosReport(config.seed, "hosts", config.durability, replay=replay)
    rng = random.Random(config.seed)
    rng.randrange(2**32)  # the schedule's draw
    clock = time.monotonic()
    seeds = [(n.host, NODE_PORT) for n in cluster.nodes]
    workers = config.workers or (4 if config.durability == "none" else 8)
    loader = Loader(
        seeds, durability=config.durability, rng=random.Random(rng.random()), clock=clock,
        workers=workers, keys=config.keys,
    )  # fmt: skip
    consumer = ChaosConsumer(seeds, cluster.vbuckets, random.Random(rng.random()))
    nemesis = HostNemesis(cluster, clock)
    mirror = HostMirrorJob(cluster, workdir / "tables", workdir / "mirror.log") if (
        config.mirror) else None  # fmt: skip
    truth: dict[bytes, Version] = {}
    sdk_records: list[dict[str, Any]] = []
    playing = threading.Thread(target=nemesis.run, args=(steps,), daemon=True)
    level = config.durability if config.durability in DURABLE_LEVELS else "majority"
    writer = (
        SdkWriter(
            cluster,
            workdir,
            seed=config.seed % 10**6,
            workers=config.sdk_workers,
            durability=level,
        )
        if config.sdk
        else None
    )
    try:
        if mirror is not None:
            mirror.start()
        if writer is not None:
            writer.__enter__()
        playing.start()

        async def chaos() -> None:
            writing = asyncio.create_task(loader.run())
            consuming = asyncio.create_task(consumer.run())
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
                if writer is not None:
                    sdk_records.extend(await asyncio.to_thread(writer.stop))
            try:
                await cluster.wait_converged(timeout_s=CONVERGE_S)
            except TimeoutError as error:
                report.notes.append(f"not converged: {str(error)[:600]}")
            truth.update(await store_truth(cluster))
            await check_everything(report, truth, cluster, consumer, mirror)
            consumer.stop()
            await consuming

        cluster.run(chaos(), timeout_s=config.duration_s + 900.0)
    finally:
        nemesis.stop()
        if playing.is_alive():
            playing.join(NEMESIS_JOIN_S)  # it heals the fault it is in, then returns
        nemesis.heal_all()
        if writer is not None:
            writer.__exit__(None, None, None)
        if mirror is not None:
            mirror.stop()
    report.writes = loader.writes
    report.faults = nemesis.faults
    final = {key: None if v.deleted else v.value for key, v in truth.items()}
    report.write_check = check_writes(loader.writes, final)
    if writer is not None:
        add_sdk_check(report, sdk_records, truth)
    report.notes += [f"nemesis: {e}" for e in nemesis.errors]
    report.notes.append(
        f"loader: {loader.stats.connects} connects, errors {loader.stats.errors}; consumer: "
        f"{consumer.history.items} items, {consumer.history.rollbacks} rollbacks, "
        f"{consumer.history.disconnects} disconnects, {consumer.history.refusals} refused/ended, "
        f"{consumer.history.restarts} restarts"
    )
    report.notes += [f"loader: first {k}: {m}" for k, m in loader.stats.examples.items()]
    report.notes += [f"consumer: {e}" for e in consumer.errors[:5]]
    for node in cluster.nodes:
        errors = node.errors_in_log()
        if errors:
            report.notes.append(f"{node.root.name} log has {len(errors)} error lines: {errors[:2]}")
    return report


def add_sdk_check(
    report: ChaosReport, records: list[dict[str, Any]], truth: dict[bytes, Version]
) -> None:
    """The SDK writer's records against the truth, as extra counts of ``report``
    (``check`` reads a final change's value, CAS and deletedness, which ``Version`` has)."""
    final: dict[str, Any] = {key.decode(errors="replace"): v for key, v in truth.items()}
    sdk = check_sdk(records, final)
    report.extra = {
        "SDK: lost acknowledged fresh writes": sdk.lost_fresh,
        "SDK: lost acknowledged CAS updates": sdk.lost_cas,
        "SDK: phantom values": sdk.phantom,
        "SDK: CAS differing from the SDK's": sdk.cas_mismatch,
    }
    report.notes.append(
        f"SDK writer: {sdk.writes} writes, {sdk.acked} acked ({sdk.acked_cas} CAS updates), "
        f"{sdk.failed} failed, {sdk.ambiguous} ambiguous, {sdk.keys_checked} keys"
    )


async def probe(cluster: HostCluster, durability: Durability) -> str:
    """One write at ``durability`` on the healthy cluster: "" if acknowledged."""
    node = cluster.nodes[0]
    async with await KvClient.connect(node.host, NODE_PORT) as kv:
        try:
            await kv.upsert(b"chaos-probe", b"probe", durability=durability)
        except DurabilityImpossibleError as error:
            return repr(error)
    return ""


async def store_truth(cluster: HostCluster) -> dict[bytes, Version]:
    """The store's final state: each vbucket streamed from its active, from the beginning."""
    node = next(n for n in cluster.nodes if n.alive)
    state, _ = await stream_to_latest(node, host=node.host)
    assert not state.rollbacks, state.rollbacks
    return {
        key: Version(c.seqno, c.value, c.cas, c.rev_seqno, c.deleted)
        for key, c in state.latest().items()
    }


async def check_everything(
    report: ChaosReport,
    truth: dict[bytes, Version],
    cluster: HostCluster,
    consumer: ChaosConsumer,
    mirror: MirrorJob | None,
) -> None:
    """The replica, order, consumer and mirror checks (the writes' check runs afterwards)."""
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


async def replica_check(cluster: HostCluster) -> list[str]:
    """Every node's copy of every vbucket it holds under the newest map, against the active's
    (one DCP client per node over all its vbuckets)."""
    cmap = await cluster.newest_map()
    held: dict[str, list[int]] = {}
    for vb in range(cmap.vbuckets):
        for holder in [cmap.active(vb), *cmap.replica_nodes(vb)]:
            if holder is not None:
                held.setdefault(holder.host, []).append(vb)
    copies: dict[int, dict[str, Copy]] = {}  # vb -> host -> copy
    unreadable: list[str] = []
    for host, vbs in held.items():
        node = cluster.node_at(host)
        try:
            changes = await copy_of(node, vbs)
            highs = await seqnos(node)
            purged = await purge_seqnos(node)
        except (OSError, TimeoutError, AssertionError) as error:
            unreadable.append(f"{node.root.name}: its copies could not be read: {error!r}")
            continue
        for vb in vbs:
            copies.setdefault(vb, {})[host] = Copy(
                node.root.name, changes[vb], highs[vb][0], purged.get(vb, 0)
            )
    pairs: dict[int, tuple[Copy, list[Copy]]] = {}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        found = copies.get(vb, {})
        if active is None or active.host not in found:
            unreadable.append(f"vb {vb}: no readable active in map rev {cmap.rev}")
            continue
        pairs[vb] = (
            found[active.host],
            [found[r.host] for r in cmap.replica_nodes(vb) if r.host in found],
        )
    return unreadable + check_replicas(pairs)
