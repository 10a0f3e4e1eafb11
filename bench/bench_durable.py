"""Durable writes on one node (issue 29 item 3): the node's CPU per write at durability
``majority`` next to ``none`` in the same run, alternating, on one default (fsync) node.

A node with no replicas meets ``majority`` once the prepare is persisted here, so the rows
measure the active's own SyncWrite path: the per-frame durable SET, the prepare queued, the
waiter, the flush of prepares and commits, the commit run and its answers. The 3-node rows
(replicas 1, the replica's share included) are ``bench_cluster.py --only durable``.

Command: ``.venv/bin/python bench/bench_durable.py`` (``--items``, ``--reps``); docs/benchmarks.md
has results. ``KvClient.upsert_many`` of all items (windows of 4,096, new keys each run, 11-byte
keys, 100-byte values, 64 vbuckets); CPU from /proc of the node's pid.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_node import Meter, Usage, run_loop
from node_bench_procs import node_process

from changefeed.consumer import KvClient
from changefeed.consumer.kv_client import Durability

VBUCKETS = 64
VALUE = b"v" * 100
LEVELS: tuple[Durability, ...] = ("none", "majority")


async def upsert(port: int, pid: int, items: list[tuple[bytes, bytes]], level: Durability) -> Usage:
    kv = await KvClient.connect("127.0.0.1", port)
    try:
        with Meter(pid) as meter:
            written = await kv.upsert_many(items, durability=level)
    finally:
        await kv.close()
    assert len(written) == len(items), (len(written), len(items))
    assert meter.usage is not None
    return meter.usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3, help="none/majority pairs")
    args = parser.parse_args()
    cpu: dict[str, list[float]] = {"none": [], "majority": []}
    rate: dict[str, list[float]] = {"none": [], "majority": []}
    with (
        tempfile.TemporaryDirectory(prefix="bench-durable-") as work,
        node_process(Path(work) / "n1", vbuckets=VBUCKETS) as node,
    ):
        for rep in range(args.reps):
            for level in LEVELS:
                items = [(b"%s-%06d" % (level[:3].encode(), rep * args.items + i), VALUE)
                         for i in range(args.items)]  # fmt: skip
                usage = run_loop(upsert(node.port, node.pid, items, level))
                cpu[level].append(usage.server_cpu_s * 1e6 / args.items)
                rate[level].append(args.items / usage.seconds)
    print(f"one default node, {args.items:,} writes a run, {args.reps} runs each, alternating; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for level in LEVELS:
        runs = " / ".join(f"{value:.1f}" for value in cpu[level])
        print(f"  durability {level:8s} node CPU us/write {runs} (median "
              f"{statistics.median(cpu[level]):.1f}); writes/s median "
              f"{statistics.median(rate[level]):,.0f}")  # fmt: skip
    ratio = statistics.median(rate["majority"]) / statistics.median(rate["none"])
    cost = statistics.median(cpu["majority"]) / statistics.median(cpu["none"])
    print(f"  majority / none: {ratio:.2f}x the rate, {cost:.2f}x the node CPU per write")


if __name__ == "__main__":
    main()
