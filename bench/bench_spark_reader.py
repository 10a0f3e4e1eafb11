"""The Spark source's read task alone: CPU per change of the reader and of the node.

A node (64 vbuckets, ``--no-durable``) is loaded with N upserts (10-byte keys, 100-byte
values, as ``bench_spark.py``), then this process reads every vbucket from seqno 0 to its high
seqno with the source's own read (``spark.reading.read_ranges_sync``: DCP, decode, Arrow
rows), ``--reps`` times. Per repetition: wall time, this process's CPU per change (the reader:
what a Spark read task's Python worker spends) and the node's CPU per change (``/proc``). Each
repetition's rows are checked after its timing (a reader losing rows would look faster): one
mutation per key loaded, every key once, and each vbucket's seqnos exactly 1..its high seqno.
``--profile`` prints cProfile's top functions of the last repetition.

To compare two trees, run it with ``PYTHONPATH`` at the other tree's ``src`` (a ``git
archive`` copy), alternating::

    .venv/bin/python bench/bench_spark_reader.py 300000 --reps 6
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/bench_spark_reader.py 300000 --reps 6

The node is stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_spark
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.spark.node_state import fetch_latest_sync
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange, read_ranges_sync

FLUSH_WAIT_S = 2.0  # for the node's flusher after the load (reads then come from disk)


def node_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_rows(batches: list[pa.RecordBatch], changes: int, ranges: list[VbRange]) -> int:
    """The number of rows read, once they are checked to be exactly the load: ``changes``
    mutations, of keys ``key_of(0..changes-1)`` each once, and per vbucket the seqnos 1 to its
    high seqno (the read's end), each once.

    Raises:
        SystemExit: rows missing, doubled or foreign, naming the first difference.
    """
    table = pa.Table.from_batches(batches) if batches else None
    if table is None or table.num_rows != changes:
        raise SystemExit(
            f"read {0 if table is None else table.num_rows:,} rows, loaded {changes:,}"
        )
    if pc.any(pc.not_equal(table.column("op"), "mutation")).as_py():
        raise SystemExit("a row that is not a mutation")
    keys = pc.sort_indices(table.column("key"))
    expected = pa.array([bench_spark.key_of(n).decode() for n in range(changes)], pa.string())
    if not table.column("key").take(keys).combine_chunks().equals(expected):
        raise SystemExit("the keys read are not the keys loaded, each once")
    order = table.select(["vbucket", "seqno"]).sort_by([("vbucket", "ascending"),
                                                         ("seqno", "ascending")])  # fmt: skip
    wanted = [(r.vbucket, s) for r in sorted(ranges, key=lambda r: r.vbucket)
              for s in range(1, r.end_seqno + 1)]  # fmt: skip
    got = list(zip(order.column("vbucket").to_pylist(), order.column("seqno").to_pylist(),
                   strict=True))  # fmt: skip
    if got != wanted:
        first = next((i for i, (a, b) in enumerate(zip(got, wanted, strict=False)) if a != b), 0)
        raise SystemExit(f"(vbucket, seqno) differ from the load at row {first}")
    return table.num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("changes", type=int, nargs="?", default=300_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import changefeed.spark.reading as reading

    print(f"# bench_spark_reader {args.changes:,} changes, {args.reps} reps; {reading.__file__}")
    work = Path(tempfile.mkdtemp(prefix="bench-reader-"))
    node = bench_spark.start_node(work / "node")
    try:
        asyncio.run(bench_spark.load(node.port, args.changes))
        time.sleep(FLUSH_WAIT_S)
        options = SourceOptions.parse(node.source_options(format="binary"))
        latest, _ = fetch_latest_sync(options)
        ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in sorted(latest.items())]
        readers, nodes = [], []
        profile = cProfile.Profile()
        for rep in range(args.reps):
            profiling = args.profile and rep == args.reps - 1
            cpu, node_at, wall = time.process_time(), node_cpu_s(node.pid), time.perf_counter()
            if profiling:
                profile.enable()
            batches = list(read_ranges_sync(options, ranges))
            if profiling:
                profile.disable()
            wall = time.perf_counter() - wall
            reader_cpu = time.process_time() - cpu
            rows = check_rows(batches, args.changes, ranges)
            reader_us = 1e6 * reader_cpu / rows
            node_us = 1e6 * (node_cpu_s(node.pid) - node_at) / rows
            if not profiling:
                readers.append(reader_us)
                nodes.append(node_us)
            print(f"rep {rep}: {rows:,} rows, {wall:.2f} s, reader {reader_us:.2f} µs/change, "
                  f"node {node_us:.2f} µs/change, load {os.getloadavg()[0]:.1f}"
                  f"{' (profiled)' if profiling else ''}")  # fmt: skip
        if readers:
            print(f"reader µs/change: best {min(readers):.2f}, median "
                  f"{statistics.median(readers):.2f}; node: best {min(nodes):.2f}, median "
                  f"{statistics.median(nodes):.2f}")  # fmt: skip
        if args.profile:
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    finally:
        node.stop()


if __name__ == "__main__":
    main()
