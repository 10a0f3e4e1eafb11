"""A raw DCP reader against the node, from memory and from disk, before/after, next to Redis.

Issue 29 item 5 asks a DCP stream to cost the node no more than Redis's XREAD costs Redis.
This measures the node's CPU per streamed item under the raw DCP reader of
``bench_raw_clients.py`` (headers only, no flow control, every vbucket from seqno 0), with
two source trees side by side: "after" (this checkout, or ``--after DIR``) and, with
``--before DIR``, a ``git archive`` of an earlier commit's ``src`` on the nodes' ``PYTHONPATH``
(``--after`` too when others' half-made edits are in the checkout). The two trees'
streams alternate in the same minutes, so the load (four engineers on two cores) hits both.

* memory: a ``--no-durable`` node with a checkpoint quota far above the load and a parked
  DCP connection (``bench_node.park_cursors``) holding its cursors at seqno 0, so every
  stream from the beginning is served from the checkpoints;
* disk: a default node, loaded, then restarted cleanly: every stream is a backfill.

Redis gets the same count as XADDs, read by the raw RESP ``XREAD COUNT 10000`` loop and by
redis-py. Every figure is the server's CPU per item (``/proc/<pid>/stat``, all threads).

Usage::

    git archive <commit> src | tar -x -C /tmp/before
    .venv/bin/python bench/bench_dcp_raw.py --before /tmp/before/src --items 200000 --reps 3
    .venv/bin/python bench/bench_dcp_raw.py --profile      # py-spy of the after node too
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_raw_clients as raw
from bench_node import MEMORY_QUOTA_BYTES, park_cursors, stream_all, wait_flushed
from node_bench_procs import RedisProcess, SpySampler, node_process, stop_children, top_self_time

from changefeed.cli.node_process import NodeProcess


def load(node: NodeProcess, count: int) -> None:
    """`count` raw SETs, windows of 4,096, two in flight (the load is not measured), persisted."""
    ops = [("set", n) for n in range(count)]
    sock = raw.mcbp_login(node.port)
    try:
        raw.raw_run(sock, raw.mcbp_requests(ops, False), raw.Shape("load", 4096, 2),
                    raw.mcbp_parser(ops))  # fmt: skip
        highs = dict(raw.VB_SEQNO.iter_unpack(raw.mcbp_call(sock, raw.OP_GET_ALL_VB_SEQNOS, b"")))
    finally:
        sock.close()
    # The flusher done first: the streams are timed, not the flush of the load behind them.
    asyncio.run(wait_flushed(node.port, highs))


READER = "raw"  # or "kv": bench_node's DcpClient (flow control, 8 MiB window, acks at 20%)


def stream_once(node: NodeProcess, count: int, source: str) -> tuple[float, float]:
    """One DCP read of everything: the node's CPU µs per item, items/s.

    With the kv reader, every item must come from `source` ("memory" or "disk", as the
    snapshot markers say): a memory row served by a backfill would measure the wrong path.
    """
    got: list[int] = []
    if READER == "kv":
        sock = raw.mcbp_login(node.port)
        try:
            value = raw.mcbp_call(sock, raw.OP_GET_ALL_VB_SEQNOS, b"")
        finally:
            sock.close()
        highs = dict(raw.VB_SEQNO.iter_unpack(value))

        def read() -> None:
            result = asyncio.run(stream_all(node.port, node.pid, highs, 8 << 20))
            assert result.items_from.get(source) == count, (source, result.items_from, count)
            got.append(result.items_from[source])

        measured = raw.measure(node.pid, count, read)
    else:
        measured = raw.measure(node.pid, count, lambda: got.append(raw.dcp_read_all(node.port)))
    assert got == [count], (got, count)
    return measured.server_us, measured.rate


def start_nodes(
    stack: ExitStack, work: Path, trees: dict[str, str | None], flags: list[str]
) -> dict[str, NodeProcess]:
    nodes = {}
    for label, tree in trees.items():
        node = node_process(work / label, vbuckets=raw.VBUCKETS, extra=flags)
        if tree is not None:
            node.env["PYTHONPATH"] = tree
        nodes[label] = stack.enter_context(node)
    return nodes


def alternate(
    nodes: dict[str, NodeProcess], count: int, reps: int, spy: Path | None, source: str
) -> dict[str, list[tuple[float, float]]]:
    """`reps` rounds, each streaming every tree once (order flipped every round), every item
    from `source`."""
    results: dict[str, list[tuple[float, float]]] = {label: [] for label in nodes}
    labels = list(nodes)
    for rep in range(reps):
        for label in labels if rep % 2 == 0 else labels[::-1]:
            results[label].append(stream_once(nodes[label], count, source))
    if spy is not None:
        with SpySampler(nodes["after"].pid, spy):
            for _ in range(4):
                stream_once(nodes["after"], count, source)
    return results


def redis_rows(count: int, work: Path) -> dict[str, float]:
    with RedisProcess(work / "redis") as redis:
        raw.redis_xadd_all(redis.port, count)
        out = {}
        readers: tuple[tuple[str, Callable[[int, int], int]], ...] = (
            ("raw RESP XREAD", raw.xread_raw),
            ("redis-py XREAD", raw.xread_redis_py),
        )
        for name, read in readers:
            peer = raw.measure(redis.pid, count, lambda read=read: read(redis.port, count) and None)
            out[name] = peer.server_us
            out[name + " items/s"] = peer.rate
        return out


def summary(label: str, runs: list[tuple[float, float]]) -> str:
    each = " / ".join(f"{us:.2f}" for us, _ in runs)
    rates = " / ".join(f"{rate / 1e3:,.0f}k" for _, rate in runs)
    median = statistics.median(us for us, _ in runs)
    return f"| {label} | {each} | {median:.2f} | {rates} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", help="a src directory (git archive) for the 'before' nodes")
    parser.add_argument(
        "--after", help="a src directory for the 'after' nodes (default: this checkout's)"
    )
    parser.add_argument("--only", choices=["memory", "disk", "both"], default="both")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument(
        "--reader", choices=["raw", "kv"], default="raw", help="kv: DcpClient, flow control"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the after node")
    args = parser.parse_args()
    global READER
    READER = args.reader
    trees: dict[str, str | None] = {"after": args.after}
    if args.before:
        trees = {"before": args.before, "after": args.after}
    work = Path(tempfile.mkdtemp(prefix="bench-dcp-raw-"))
    print(
        f"# bench_dcp_raw: {args.reader} reader, {args.items:,} items, {raw.VBUCKETS} vbuckets, "
        f"load {raw.load_average()}"
    )
    lines = ["| node CPU µs/item | runs | median | items/s |", "|---|---|---:|---|"]
    profiles: list[str] = []
    try:
        if args.only in ("memory", "both"):
            flags = ["--checkpoint-quota-bytes", str(MEMORY_QUOTA_BYTES), "--no-durable"]
            with ExitStack() as stack:
                nodes = start_nodes(stack, work / "memory", trees, flags)
                loop = asyncio.new_event_loop()
                parked = [loop.run_until_complete(park_cursors(n.port)) for n in nodes.values()]
                for node in nodes.values():
                    load(node, args.items)
                spy = work / "spy-memory.txt" if args.profile else None
                results = alternate(nodes, args.items, args.reps, spy, "memory")
                for conn in parked:
                    loop.run_until_complete(conn.close())
                loop.close()
                for label, values in results.items():
                    lines.append(summary(f"memory, {label}", values))
                if spy is not None:
                    profiles += ["## profile, memory (after)", *top_self_time(spy, 30)]
            print(f"# memory done, load {raw.load_average()}", flush=True)
        if args.only in ("disk", "both"):
            with ExitStack() as stack:
                nodes = start_nodes(stack, work / "disk", trees, [])
                for node in nodes.values():
                    load(node, args.items)
                    node.restart()  # a clean stop persists everything: all backfill
                spy = work / "spy-disk.txt" if args.profile else None
                results = alternate(nodes, args.items, args.reps, spy, "disk")
                for label, values in results.items():
                    lines.append(summary(f"disk, {label}", values))
                if spy is not None:
                    profiles += ["## profile, disk (after)", *top_self_time(spy, 30)]
            print(f"# disk done, load {raw.load_average()}", flush=True)
        if not args.no_redis:
            redis = redis_rows(args.items, work)
            for name, value in redis.items():
                if not name.endswith("items/s"):
                    rate = redis[name + " items/s"]
                    lines.append(
                        f"| Redis, {name} | {value:.2f} | {value:.2f} | {rate / 1e3:,.0f}k |"
                    )
    except BaseException:
        stop_children()
        print(f"# failed: work directory kept at {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    print("\n".join(profiles))
    print(f"# load average at end: {raw.load_average()} (cpus {os.cpu_count()})")


if __name__ == "__main__":
    main()
