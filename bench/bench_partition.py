"""Partition benchmark (issue 25, "Benchmarks"): availability of durable writes to the faulted
node's vbuckets during each fault type, on test hosts (``tests/support/hosts.py``: each node
and each of 3 etcd members in a network namespace of its own behind a router; partitions are
silent drops there).

For each cluster size (``--sizes``, default 3 and 5 nodes, replicas 2, 16 vbuckets, the default
lease ``--lease`` 5 s) and each fault (``--faults``):

* ``isolate``: a full partition of one node (from nodes, etcd and the client);
* ``kill -9``: SIGKILL of the node (started again after the fault);
* ``pause``: SIGSTOP of the node (SIGCONT after the fault);
* ``orch pause``: SIGSTOP of the orchestrator node (etcd's leader key names it);
* ``etcd cut``: the node cut from every etcd member, not from its peers or the client;
* ``split``: a minority/majority split: the node (with 5 nodes: and the node holding most of
  its replicas) and its own etcd member on one side, the rest on the other; the client is on
  neither side and reaches both (so the minority side could try to acknowledge).

the victim is the node leading the most vbuckets that is not the orchestrator (except for
``orch pause``). ``--probes`` probe tasks on the client host each write, one at a time, durable
(majority) upserts of a key of one vbucket the victim leads (with 5 nodes and ``split``, one
whose replica is on the victim's side first), through ``KvClient`` (which follows the map); each
attempt has ``ATTEMPT_S`` seconds, after which the client is dropped and a new one bootstraps
from a random node (so a client stuck on a dead connection costs at most that). The probes run
from ``WARM_S`` before the fault to its end (``--fault-s`` seconds); then the fault is healed
and the cluster converges; each fault gets a fresh cluster. Per fault, over the probed vbuckets:

* **served again**: seconds from the fault's start to the end of the first gap longer than
  ``GAP_S`` between acknowledgements (0: no such gap), the worst vbucket;
* **available**: share of the fault's time not inside a gap longer than ``GAP_S`` (the fault's
  start and end count as acknowledgements), the mean over vbuckets, and the worst;
* **longest gap**: the longest time without an acknowledgement, the worst vbucket.

Usage::

    .venv/bin/python bench/bench_partition.py                  # 3 and 5 nodes, every fault
    .venv/bin/python bench/bench_partition.py --sizes 3 --faults isolate,kill --fault-s 10

Needs root (network namespaces). Every namespace and process it makes is removed on the way
out (``HostCluster``), also on an error or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_node import log, machine, source_tree  # noqa: E402

from changefeed.cluster.metadata import ClusterMetadata  # noqa: E402
from changefeed.consumer import KvClient  # noqa: E402
from changefeed.consumer.connection import ConnectionClosedError  # noqa: E402
from changefeed.protocol.errors import StatusError  # noqa: E402
from changefeed.vbmap import ClusterMap, vbucket_for_key  # noqa: E402
from support.cluster import wait_in_sync_published  # noqa: E402
from support.hosts import NODE_PORT, Host, HostCluster  # noqa: E402

FAULTS = ("isolate", "kill", "pause", "orch-pause", "etcd-cut", "split")
LABELS = {
    "isolate": "isolate one node",
    "kill": "kill -9",
    "pause": "pause (SIGSTOP)",
    "orch-pause": "orchestrator pause",
    "etcd-cut": "node cut from etcd only",
    "split": "minority/majority split",
}
VBUCKETS = 16
REPLICAS = 2
LEASE_S = 5
ATTEMPT_S = 1.0  # one durable write's budget before the probe drops its client
CONNECT_S = 0.5  # a new client bootstraps from a random node: a cut-off one costs this
GAP_S = 0.5  # a gap between acknowledgements longer than this is unavailability
WARM_S = 2.0
CONVERGE_S = 120.0


@dataclass
class Probe:
    vb: int
    acks: list[float] = field(default_factory=list)  # monotonic times of acknowledgements
    errors: dict[str, int] = field(default_factory=dict)
    reconnects: int = 0


@dataclass
class Result:
    nodes: int
    fault: str
    victim: str
    fault_s: float
    probes: list[Probe]
    served_again_s: float = 0.0
    promoted_s: float | None = None  # etcd's map names another active for every probed vb
    available: list[float] = field(default_factory=list)
    longest_gap_s: float = 0.0
    load: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summarise(self, start: float) -> None:
        for probe in self.probes:
            acks = sorted(t - start for t in probe.acks if start <= t <= start + self.fault_s)
            points = [0.0, *acks, self.fault_s]
            gaps = [(a, b) for a, b in itertools.pairwise(points) if b - a > GAP_S]
            down = sum(b - a for a, b in gaps)
            self.available.append(1.0 - down / self.fault_s)
            self.longest_gap_s = max(
                self.longest_gap_s, max(b - a for a, b in itertools.pairwise(points))
            )
            first = gaps[0][1] if gaps else 0.0
            self.served_again_s = max(self.served_again_s, first)


def key_for(vb: int, salt: str) -> bytes:
    n = 0
    while True:  # a key of any vbucket turns up within a few hundred tries
        key = f"probe-{salt}-{n}".encode()
        if vbucket_for_key(key, VBUCKETS) == vb:
            return key
        n += 1


async def probe_loop(
    cluster: HostCluster, probe: Probe, stop: asyncio.Event, rng: random.Random
) -> None:
    key = key_for(probe.vb, f"{probe.vb}-{rng.randrange(10**9)}")
    kv: KvClient | None = None
    hosts = [n.host for n in cluster.nodes]
    number = 0
    try:
        while not stop.is_set():
            if kv is None:
                try:
                    async with asyncio.timeout(CONNECT_S):
                        kv = await KvClient.connect(rng.choice(hosts), NODE_PORT)
                except (OSError, TimeoutError, ConnectionClosedError, StatusError) as error:
                    name = type(error).__name__
                    probe.errors[name] = probe.errors.get(name, 0) + 1
                    await asyncio.sleep(0.05)  # a refused connection fails at once
                    continue
            number += 1
            try:
                async with asyncio.timeout(ATTEMPT_S):
                    await kv.upsert(key, b"%d" % number, durability="majority")
                probe.acks.append(time.monotonic())
            except (OSError, TimeoutError, ConnectionClosedError, StatusError) as error:
                name = type(error).__name__
                probe.errors[name] = probe.errors.get(name, 0) + 1
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await kv.close()
                kv = None
                probe.reconnects += 1
    finally:
        if kv is not None:
            with contextlib.suppress(Exception):
                await kv.close()


async def watch_promotion(
    cluster: HostCluster, victim: str, vbuckets: list[int], stop: asyncio.Event
) -> float | None:
    """When etcd's map first names another active than ``victim`` for every one of
    ``vbuckets`` (monotonic time), polled every 50 ms through any member that answers."""
    while not stop.is_set():
        for member in cluster.etcd:
            if not member.alive:
                continue
            try:
                async with asyncio.timeout(0.5):
                    md = await ClusterMetadata.connect(member.endpoint, cluster.cluster)
                    async with md:
                        stored = await md.read_map()
            except Exception:  # a member cut off or without quorum: ask another
                continue
            if stored is not None:
                cmap = stored[0]
                actives = [cmap.active(vb) for vb in vbuckets]
                if all(a is not None and a.host != victim for a in actives):
                    return time.monotonic()
                break
        await asyncio.sleep(0.05)
    return None


async def orchestrator(cluster: HostCluster) -> str | None:
    async with await ClusterMetadata.connect(cluster.etcd[0].endpoint, cluster.cluster) as md:
        found = await md.leader()
    return None if found is None else found[0]


def led_by(cmap: ClusterMap) -> dict[str, list[int]]:
    led: dict[str, list[int]] = {n.host: [] for n in cmap.nodes}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        if active is not None:
            led[active.host].append(vb)
    return led


@dataclass
class Plan:
    victim: int  # node index
    side: list[int]  # node indexes on the victim's side (split)
    vbuckets: list[int]


def plan(cluster: HostCluster, fault: str, probes: int) -> Plan:
    cmap = cluster.run(cluster.newest_map())
    leader = cluster.run(orchestrator(cluster))
    names = {h.name: i for i, h in enumerate(cluster.node_hosts)}
    leader_index = names.get(leader) if leader is not None else None
    led = led_by(cmap)
    index_of = {n.host: i for i, n in enumerate(cluster.nodes)}
    if fault == "orch-pause":
        assert leader_index is not None, "no orchestrator"
        victim = leader_index
    else:
        pool = [h for h in led if index_of[h] != leader_index and led[h]]
        pool = pool or [h for h in led if led[h]]
        victim = index_of[max(pool, key=lambda h: len(led[h]))]
    host = cluster.nodes[victim].host
    vbs = list(led[host])
    side = [victim]
    if fault == "split" and cluster.node_count >= 5:
        counts: dict[str, int] = {}
        for vb in vbs:
            for replica in cmap.replica_nodes(vb):
                counts[replica.host] = counts.get(replica.host, 0) + 1
        partner = max(counts, key=lambda h: counts[h])
        side.append(index_of[partner])
        both = [vb for vb in vbs if any(r.host == partner for r in cmap.replica_nodes(vb))]
        vbs = both + [vb for vb in vbs if vb not in both]
    return Plan(victim, side, vbs[:probes])


def inject(cluster: HostCluster, fault: str, chosen: Plan) -> Callable[[], None]:
    """Inject ``fault``; returns the function that heals it."""
    network = cluster.network
    node = cluster.nodes[chosen.victim]
    host = cluster.node_hosts[chosen.victim]
    if fault == "isolate":
        network.isolate(host)
        return network.heal
    if fault == "etcd-cut":
        network.cut([host], cluster.etcd_hosts)
        return network.heal
    if fault == "split":
        member = cluster.etcd_hosts[chosen.victim % len(cluster.etcd_hosts)]
        small: list[Host] = [cluster.node_hosts[i] for i in chosen.side] + [member]
        large = [h for h in [*cluster.node_hosts, *cluster.etcd_hosts] if h not in small]
        network.partition(small, large)
        return network.heal
    if fault == "kill":
        node.kill()

        def restart() -> None:
            cluster.restart_node(chosen.victim)

        return restart
    assert fault in ("pause", "orch-pause"), fault
    os.killpg(node.pid, signal.SIGSTOP)
    return lambda: os.killpg(node.pid, signal.SIGCONT)


def settle(cluster: HostCluster) -> None:
    cluster.run(cluster.wait_converged(timeout_s=CONVERGE_S))
    cluster.run(wait_in_sync_published(cluster.etcd[0].endpoint, cluster.cluster, timeout_s=60))


def one_fault(
    cluster: HostCluster, fault: str, args: argparse.Namespace, rng: random.Random
) -> Result:
    settle(cluster)
    chosen = plan(cluster, fault, args.probes)
    victim = cluster.node_hosts[chosen.victim].name
    result = Result(
        cluster.node_count, fault, victim, args.fault_s, [Probe(vb) for vb in chosen.vbuckets]
    )
    result.load = os.getloadavg()[0]
    heal: Callable[[], None] | None = None
    started = 0.0

    async def measure() -> None:
        nonlocal heal, started
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(probe_loop(cluster, p, stop, random.Random(rng.random())))
            for p in result.probes
        ]
        watching: asyncio.Task[float | None] | None = None
        try:
            await asyncio.sleep(WARM_S)
            started = time.monotonic()
            heal = await asyncio.to_thread(inject, cluster, fault, chosen)
            watching = asyncio.create_task(
                watch_promotion(cluster, cluster.nodes[chosen.victim].host, chosen.vbuckets, stop)
            )
            await asyncio.sleep(max(0.0, started + args.fault_s - time.monotonic()))
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            if watching is not None:
                promoted = await watching
                if promoted is not None:
                    result.promoted_s = promoted - started

    try:
        cluster.run(measure(), timeout_s=args.fault_s + 120)
    finally:
        if heal is not None:
            heal()
        cluster.network.heal()
    result.summarise(started)
    settle(cluster)  # healed: the run ends on a converged cluster (or says why not)
    for probe in result.probes:
        if probe.errors:
            result.notes.append(f"vb {probe.vb}: {probe.errors}, {probe.reconnects} new clients")
    return result


def table(results: list[Result], args: argparse.Namespace) -> list[str]:
    head = (
        f"{'fault':<34} {'nodes':>5} {'victim':>6} "
        f"{'promoted s':>10} {'served again s':>14} {'available mean / worst':>22} "
        f"{'longest gap s':>13} "
        f"{'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        avail = f"{100 * statistics.mean(r.available):.0f} % / {100 * min(r.available):.0f} %"
        lines.append(
            f"{LABELS[r.fault]:<34} {r.nodes:>5} {r.victim:>6} {_f(r.promoted_s):>10} "
            f"{r.served_again_s:>14.2f} "
            f"{avail:>22} {r.longest_gap_s:>13.2f} {r.load:>5.1f}"
        )
    lines.append(
        "(promoted: etcd's map names another active for every probed vbucket, '-' never "
        "during the fault;"
    )
    lines.append(
        f" fault {args.fault_s:g} s each; lease {args.lease} s; {args.probes} probed vbuckets; "
        f"a gap > {GAP_S} s between acks is unavailable; write attempt budget {ATTEMPT_S} s)"
    )
    return lines


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="3,5", help="cluster sizes (nodes), comma-separated")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"any of {','.join(FAULTS)}")
    parser.add_argument("--fault-s", type=float, default=15.0, help="seconds each fault lasts")
    parser.add_argument("--lease", type=int, default=LEASE_S, help="--failover-timeout-s")
    parser.add_argument("--probes", type=int, default=4, help="vbuckets probed per fault")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.size_list = [int(s) for s in args.sizes.split(",")]
    args.fault_list = args.faults.split(",")
    assert set(args.fault_list) <= set(FAULTS), args.fault_list
    assert all(n >= 3 for n in args.size_list), args.size_list
    return args


def main() -> None:
    args = parse_args()
    assert os.geteuid() == 0, "test hosts need root (network namespaces)"
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through HostCluster
    began = time.perf_counter()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench_partition_") as work:
        for size in args.size_list:
            for fault in args.fault_list:
                # A fresh cluster per fault: a failover leaves the vbuckets unbalanced (no
                # automatic rebalance), and a healed node may still be registering again.
                root = Path(work) / f"n{size}-{fault}"
                with HostCluster(
                    root, nodes=size, replicas=REPLICAS, vbuckets=VBUCKETS,
                    failover_timeout_s=args.lease,
                ) as cluster:  # fmt: skip
                    result = one_fault(cluster, fault, args, rng)
                results.append(result)
                log(
                    f"{size} nodes, {fault} of {result.victim}: promoted "
                    f"{_f(result.promoted_s)} s, served again {result.served_again_s:.2f} s, "
                    f"available {100 * statistics.mean(result.available):.0f} %, longest gap "
                    f"{result.longest_gap_s:.2f} s; {'; '.join(result.notes)}"
                )
    print("\n".join([
        f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}",
        *machine(),
        source_tree(),
        f"node code: {os.environ.get('PYTHONPATH') or 'the working tree'}",
        f"test hosts: 3 etcd members, replicas {REPLICAS}, {VBUCKETS} vbuckets, "
        f"lease {args.lease} s",
        "",
        *table(results, args),
        f"total wall time {time.perf_counter() - began:.0f} s",
    ]))  # fmt: skip


if __name__ == "__main__":
    main()
