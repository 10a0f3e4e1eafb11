"""Client-side cost of pipelined ingest: ``KvClient.upsert_many`` against one node.

Starts a node (``changefeed serve``, ``--vbuckets 64``), then upserts ``--items`` items
(10-byte keys, 100-byte values) with one ``upsert_many`` call per window of ``--window`` items
(``PIPELINE_DEPTH_MAX``, as bench/bench_node.py's ``ingest``), durability "none", and prints:

* items/s (wall clock; the node is usually the slower side),
* client CPU µs per item (``time.process_time`` of the client process: what this bench is for),
  and the part of it spent in the kernel (``getrusage`` system time: the socket's share),
* node CPU µs per item (utime + stime of the node pid, /proc/<pid>/stat).

``--compare-head`` also runs the client as committed (HEAD's ``consumer/kv_client.py`` and
``consumer/connection.py`` over a copy of the working tree, so only the client differs; the node
always runs the working tree). Each variant runs in its own process, on its own fresh node, and
every run checks its results (one per item, in input order, seqnos rising per vbucket).

Usage::

    .venv/bin/python bench/bench_kv_client.py                  # 200,000 items, this tree
    .venv/bin/python bench/bench_kv_client.py --compare-head   # HEAD's client, then this one
    .venv/bin/python bench/bench_kv_client.py --profile out.prof --items 50000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
CLIENT_FILES = ("src/changefeed/consumer/kv_client.py", "src/changefeed/consumer/connection.py")
VBUCKETS = 64
VALUE_BYTES = 100
KEY_FORMAT = b"k%09d"
ITEMS_DEFAULT = 200_000
DEADLINE_S = 1800.0
T = TypeVar("T")


def make_items(count: int) -> list[tuple[bytes, bytes]]:
    """Unique 10-byte keys with distinct 100-byte values (bench_node.py's)."""
    return [(KEY_FORMAT % n, b"%0100d" % n) for n in range(count)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_loop(coroutine: Coroutine[Any, Any, T], use_uvloop: bool) -> T:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coroutine)
    return asyncio.run(coroutine)


async def ingest(
    port: int, node_pid: int, items: list[tuple[bytes, bytes]], window: int, profile: str | None
) -> dict[str, float]:
    from changefeed.consumer.kv_client import KvClient

    kv = await KvClient.connect("127.0.0.1", port)
    results = []
    profiler = cProfile.Profile() if profile else None
    try:
        async with asyncio.timeout(DEADLINE_S):
            node_cpu = cpu_seconds(node_pid)
            client_cpu = time.process_time()
            client_sys = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            started = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for first in range(0, len(items), window):
                results.extend(await kv.upsert_many(items[first : first + window]))
            if profiler is not None:
                profiler.disable()
            seconds = time.perf_counter() - started
            client_cpu = time.process_time() - client_cpu
            client_sys = resource.getrusage(resource.RUSAGE_SELF).ru_stime - client_sys
            node_cpu = cpu_seconds(node_pid) - node_cpu
    finally:
        await kv.close()
    if profiler is not None and profile:
        profiler.dump_stats(profile)
    check(items, results, kv.vbucket_of)
    n = len(items)
    return {
        "items": n,
        "seconds": seconds,
        "items_per_s": n / seconds,
        "client_us": 1e6 * client_cpu / n,
        "client_sys_us": 1e6 * client_sys / n,
        "node_us": 1e6 * node_cpu / n,
    }


def check(items: list[tuple[bytes, bytes]], results: list[Any], vbucket_of: Any) -> None:
    """One result per item, in input order: the item's vbucket, seqnos rising per vbucket."""
    assert len(results) == len(items), (len(results), len(items))
    last: dict[int, int] = {}
    for (key, _), result in zip(items, results, strict=True):
        assert result.vbucket == vbucket_of(key), (key, result)
        assert result.seqno > last.get(result.vbucket, 0), result
        assert result.cas and result.vb_uuid, result
        last[result.vbucket] = result.seqno


def child(args: argparse.Namespace) -> None:
    """One variant: a fresh node, one timed ingest; prints the figures as JSON on stdout."""
    from changefeed.cli.node_process import NodeProcess
    from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX

    window = args.window or PIPELINE_DEPTH_MAX
    items = make_items(args.items)
    node_env = {"PYTHONPATH": str(REPO / "src")}  # the node is always the working tree's
    with tempfile.TemporaryDirectory(prefix="bench-kv-client-") as work:
        node = NodeProcess(
            Path(work) / "node",
            vbuckets=VBUCKETS,
            args=["--log-level", "WARNING"],
            env=node_env,
            ready_timeout_s=60.0,
            stop_timeout_s=120.0,
        )
        with node:
            out = run_loop(
                ingest(node.port, node.pid, items, window, args.profile), not args.asyncio
            )
    out["window"] = window
    print(json.dumps(out))


def head_tree(target: Path) -> Path:
    """A copy of the working tree's package with HEAD's client files; returns its src dir."""
    src = target / "src"
    shutil.copytree(REPO / "src" / "changefeed", src / "changefeed")
    for name in CLIENT_FILES:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"HEAD:{name}"],
            capture_output=True,
            check=True,
        ).stdout
        (target / name).write_bytes(text)
    return src


def run_variant(label: str, src: Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--items", str(args.items)]
    if args.window:
        argv += ["--window", str(args.window)]
    if args.asyncio:
        argv.append("--asyncio")
    env = {**os.environ, "PYTHONPATH": str(src)}
    print(f"# running {label} ...", file=sys.stderr, flush=True)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    if done.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["label"] = label
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=ITEMS_DEFAULT)
    parser.add_argument("--window", type=int, default=0, help="default PIPELINE_DEPTH_MAX")
    parser.add_argument("--compare-head", action="store_true", help="also run HEAD's client")
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant (best kept)")
    parser.add_argument("--asyncio", action="store_true", help="asyncio instead of uvloop")
    parser.add_argument("--profile", help="cProfile the timed loop into this file (one run)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.profile:
        child(args)
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-head-") as tmp:
        variants = [("working tree", REPO / "src")]
        if args.compare_head:
            variants.insert(0, ("HEAD", head_tree(Path(tmp))))
        for label, src in variants:
            runs = [run_variant(label, src, args) for _ in range(args.repeat)]
            rows.append(min(runs, key=lambda r: r["client_us"]))
    loop = "asyncio" if args.asyncio else "uvloop"
    print(
        f"upsert_many: {args.items:,} items, 100-byte values, {VBUCKETS} vbuckets, "
        f"window {rows[0]['window']}, durability none, {loop}"
    )
    columns = ("items/s", "client µs/item", "of it sys", "node µs/item")
    print(f"{'client':<14} {columns[0]:>10} {columns[1]:>15} {columns[2]:>10} {columns[3]:>13}")
    for row in rows:
        print(
            f"{row['label']:<14} {row['items_per_s']:>10,.0f} {row['client_us']:>15.2f} "
            f"{row['client_sys_us']:>10.2f} {row['node_us']:>13.2f}"
        )


if __name__ == "__main__":
    main()
