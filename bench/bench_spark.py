"""Spark pipeline benchmark: changes/s from a node into the Delta mirror, next to Spark's rate
source feeding the same mirror writer.

Rows (one local[2] session for the whole run; every figure is one run, ``time.perf_counter``):

* **changefeed -> mirror**: a node (64 vbuckets, ``--no-durable``) loaded with N upserts of N
  distinct keys (10-byte keys, 100-byte values), then one availableNow query
  ``readStream.format("changefeed")`` (``maxOffsetsPerTrigger`` M) ``-> foreachBatch(MirrorWriter)``
  with a checkpoint. changes/s = N / (``start()`` -> ``awaitTermination()``). The mirror must end
  with N rows, and a sample of keys is checked against the node.
* **rate -> mirror**: Spark's own rate source in its per-batch form, ``rate-micro-batch``
  (``rowsPerBatch`` = M, so batch sizes and the row count equal the changefeed run's; the
  plain ``rate`` source ties rows to wall time, so its batch sizes follow the sink's speed and
  cannot be matched), mapped to the same change-row schema (10-byte keys, 100-byte values) and
  written by the same MirrorWriter into fresh tables; stopped once N rows are committed.
* **... -> noop**: both sources again into Spark's ``noop`` sink: what the source alone costs.
* Per batch: ``durationMs.triggerExecution`` from query progress (p50/p95 over the batches of
  the N runs); ``read`` and ``write`` are the shares of the run's wall time spent in
  ``batch_df.toArrow()`` (which runs the batch: the source read and the collect to the driver)
  and in ``MirrorWriter.write`` (the Delta changelog append and mirror merge).
* **latency**: a steady writer (``--latency-rate`` upserts/s for ``--latency-s``) while the
  stream runs with the default trigger; each value carries its write time, and the end-to-end
  latency of a change is (commit of its mirror batch) - (its write), p50/p95 over every change
  written in the window (``per s``: the rate actually reached). The rate source's ``timestamp``
  column plays the write time on the other side. Also triggerExecution p50/p95 meanwhile.

Usage::

    .venv/bin/python bench/bench_spark.py              # 1M and 5M changes
    .venv/bin/python bench/bench_spark.py --quick      # 100k changes
    .venv/bin/python bench/bench_spark.py --sizes 1000000,2000000

The full output goes to stdout and to ``bench/results_spark.txt`` (``--output``). Every node
and query the benchmark starts is stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import KvClient
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.spark import MirrorWriter, read_mirror

VBUCKETS = 64
VALUE_BYTES = 100
LOADERS = 4  # concurrent KV connections while loading (the node is one process, one core)
WINDOW = 4096  # upserts per upsert_many call
QUERY_DEADLINE_S = 3600.0
NODE_START_S = 60.0
NODE_STOP_S = 120.0
SAMPLE_KEYS = 200
LATENCY_DRAIN_S = 5.0


# -- node --------------------------------------------------------------------------------------


def start_node(root: Path) -> NodeProcess:
    """A started node under ``root``: 64 vbuckets, ``--no-durable``, warnings-only logging."""
    return NodeProcess(
        root,
        vbuckets=VBUCKETS,
        args=["--no-durable", "--log-level", "WARNING"],
        ready_timeout_s=NODE_START_S,
        stop_timeout_s=NODE_STOP_S,
    ).start()


def key_of(n: int) -> bytes:
    return b"k%09d" % n  # 10 bytes


def value_of(n: int, written_at: float = 0.0) -> bytes:
    """100 bytes; the first 20 hold the write time (for the latency run)."""
    return (b"%020.6f" % written_at + b"%080d" % n)[:VALUE_BYTES]


async def _upsert(kv: KvClient, items: list[tuple[bytes, bytes]]) -> None:
    for attempt in range(2000):  # TMPFAIL while the flusher catches up; ~100 s at most
        try:
            await kv.upsert_many(items)
            return
        except TemporaryFailureError:
            await asyncio.sleep(min(0.05, 0.001 * (attempt + 1)))
    raise TimeoutError("writes kept failing with TMPFAIL")


async def _load(port: int, count: int) -> None:
    async def one(first: int, last: int) -> None:
        async with await KvClient.connect("127.0.0.1", port) as kv:
            for start in range(first, last, WINDOW):
                end = min(start + WINDOW, last)
                await _upsert(kv, [(key_of(n), value_of(n)) for n in range(start, end)])

    bounds = [count * i // LOADERS for i in range(LOADERS + 1)]
    await asyncio.gather(*(one(bounds[i], bounds[i + 1]) for i in range(LOADERS)))


async def _sample_matches(port: int, mirror: pa.Table, rng: random.Random) -> int:
    keys = mirror.column("key").to_pylist()
    values = mirror.column("value").to_pylist()
    picks = rng.sample(range(len(keys)), min(SAMPLE_KEYS, len(keys)))
    async with await KvClient.connect("127.0.0.1", port) as kv:
        bad = 0
        for i in picks:
            got = await kv.get(keys[i].encode())
            bad += got.value != values[i]
    return bad


# -- measuring ---------------------------------------------------------------------------------


class TimedWriter:
    """``foreachBatch`` callable: MirrorWriter plus timing and row counting per batch."""

    def __init__(self, writer: MirrorWriter, on_batch: Callable[[pa.Table, float], None] | None):
        self.writer = writer
        self.on_batch = on_batch
        self.rows = 0
        self.batches = 0
        self.collect_s: list[float] = []
        self.writer_s: list[float] = []
        self.done_at: float | None = None
        self.done = (0, 0)  # rows and batches when target_rows was reached
        self.target_rows = 0

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        if self.done_at is not None:
            return  # past the target (a rate run before its stop): not timed, not written
        started = time.perf_counter()
        table = batch_df.toArrow()  # runs the batch: reading the source happens here
        collected = time.perf_counter()
        self.writer.write(table, batch_id)
        finished = time.perf_counter()
        self.collect_s.append(collected - started)
        self.writer_s.append(finished - collected)
        self.rows += table.num_rows
        self.batches += 1
        if self.on_batch is not None:
            self.on_batch(table, time.time())
        if self.target_rows and self.rows >= self.target_rows and self.done_at is None:
            self.done_at = finished
            self.done = (self.rows, self.batches)


@dataclass
class Run:
    name: str
    rows: int
    seconds: float
    batches: int
    trigger_ms: list[float] = field(default_factory=list)
    collect_s: list[float] = field(default_factory=list)
    writer_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def changefeed_df(spark: Any, node: NodeProcess, max_offsets: int) -> Any:
    options = node.source_options(maxOffsetsPerTrigger=str(max_offsets), partitions="2")
    return spark.readStream.format("changefeed").options(**options).load()


def rate_df(spark: Any, rows_per_batch: int) -> Any:
    raw = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", rows_per_batch)
        .option("numPartitions", 2)
        .load()
    )
    return as_change_rows(raw)


def as_change_rows(raw: Any) -> Any:
    """(timestamp, value) rows of a rate source as change rows: key ``r%09d`` (10 bytes), a
    100-byte value that starts with the row's timestamp, op mutation."""
    from pyspark.sql import functions as F

    value = F.col("value")
    return raw.select(
        (value % VBUCKETS).cast("int").alias("vbucket"),
        value.alias("seqno"),
        F.format_string("r%09d", value).alias("key"),
        F.encode(
            F.format_string("%020.6f%080d", F.unix_micros("timestamp") / 1e6, value), "US-ASCII"
        ).alias("value"),
        F.lit("mutation").alias("op"),
        value.alias("cas"),
        F.lit(0).cast("int").alias("expiry"),
        F.lit(0).cast("int").alias("flags"),
        F.lit(1).cast("long").alias("rev_seqno"),
        value.alias("snap_start"),
        value.alias("snap_end"),
    )


def run_to_mirror(
    name: str,
    df: Any,
    tables: Path,
    checkpoint: Path,
    options: dict[str, str],
    *,
    rows: int,
    available_now: bool,
) -> Run:
    """Run ``df -> foreachBatch(MirrorWriter)``: availableNow to the end, or until ``rows``."""
    writer = TimedWriter(MirrorWriter(tables, options), None)
    writer.target_rows = rows
    stream = df.writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint))
    if available_now:
        stream = stream.trigger(availableNow=True)
    started = time.perf_counter()
    query = stream.start()
    try:
        if available_now:
            assert query.awaitTermination(QUERY_DEADLINE_S), f"{name}: no end in time"
            ended = time.perf_counter()
        else:
            deadline = time.monotonic() + QUERY_DEADLINE_S
            while writer.done_at is None:  # bounded by the deadline
                assert query.exception() is None, query.exception()
                assert time.monotonic() < deadline, f"{name}: {writer.rows} rows only"
                time.sleep(0.02)
            ended = writer.done_at
            while len(_with_rows(query)) < writer.done[1] and time.monotonic() < deadline:
                time.sleep(0.02)  # the last batch's progress comes after its checkpoint commit
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    trigger_ms = [float(p["durationMs"]["triggerExecution"]) for p in _with_rows(query)]
    rows, batches = writer.done if writer.done_at is not None else (writer.rows, writer.batches)
    return Run(
        name,
        rows,
        ended - started,
        batches,
        trigger_ms[:batches],
        writer.collect_s[:batches],
        writer.writer_s[:batches],
    )


def _with_rows(query: Any) -> list[Any]:
    return [p for p in query.recentProgress if p["numInputRows"] > 0]


def run_to_noop(name: str, df: Any, checkpoint: Path, *, rows: int, available_now: bool) -> Run:
    stream = df.writeStream.format("noop").option("checkpointLocation", str(checkpoint))
    if available_now:
        stream = stream.trigger(availableNow=True)
    started = time.perf_counter()
    query = stream.start()
    try:
        if available_now:
            assert query.awaitTermination(QUERY_DEADLINE_S), f"{name}: no end in time"
        else:
            deadline = time.monotonic() + QUERY_DEADLINE_S
            while sum(p["numInputRows"] for p in query.recentProgress) < rows:  # bounded
                assert query.exception() is None, query.exception()
                assert time.monotonic() < deadline, f"{name}: too slow"
                time.sleep(0.01)
        ended = time.perf_counter()
    finally:
        query.stop()
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    done = sum(p["numInputRows"] for p in progress)
    trigger_ms = [float(p["durationMs"]["triggerExecution"]) for p in progress]
    return Run(name, done, ended - started, len(progress), trigger_ms)


# -- the runs ----------------------------------------------------------------------------------


def warm_up(spark: Any, work: Path) -> None:
    """One small run of each kind first: JIT, Python worker pools, Delta code paths."""
    root = work / "warm-up"
    root.mkdir()
    node = start_node(root)
    try:
        asyncio.run(_load(node.port, 20_000))
        run_to_mirror(
            "warm-up", changefeed_df(spark, node, 10_000), root / "t1", root / "c1",
            node.source_options(), rows=20_000, available_now=True,
        )  # fmt: skip
        run_to_mirror(
            "warm-up", rate_df(spark, 10_000), root / "t2", root / "c2",
            node.source_options(), rows=20_000, available_now=False,
        )  # fmt: skip
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


def bench_size(spark: Any, n: int, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    root = work / f"n{n}"
    root.mkdir()
    node = start_node(root)
    try:
        started = time.perf_counter()
        asyncio.run(_load(node.port, n))
        load_s = time.perf_counter() - started
        say(out, f"\n## N = {n:,} changes (load: {load_s:.1f} s, {n / load_s:,.0f} upserts/s)")

        cf = run_to_mirror(
            "changefeed -> mirror",
            changefeed_df(spark, node, args.max_offsets),
            root / "cf-tables",
            root / "cf-ck",
            node.source_options(),
            rows=n,
            available_now=True,
        )
        mirror = read_mirror(root / "cf-tables")
        bad = asyncio.run(_sample_matches(node.port, mirror, random.Random(n)))
        assert mirror.num_rows == n, (mirror.num_rows, n)
        assert bad == 0, f"{bad} of {SAMPLE_KEYS} sampled keys differ from the node"
        cf.note = f"mirror rows {mirror.num_rows:,}, {SAMPLE_KEYS} sampled keys equal the node"
        del mirror
        shutil.rmtree(root / "cf-tables")

        rate = run_to_mirror(
            "rate-micro-batch -> mirror",
            rate_df(spark, args.max_offsets),
            root / "rate-tables",
            root / "rate-ck",
            node.source_options(),
            rows=n,
            available_now=False,
        )
        rate_rows = read_mirror(root / "rate-tables").num_rows
        rate.note = f"mirror rows {rate_rows:,}"
        shutil.rmtree(root / "rate-tables")

        pairs = [(cf, rate)]
        if not args.no_noop:
            cf_noop = run_to_noop(
                "changefeed -> noop",
                changefeed_df(spark, node, args.max_offsets),
                root / "cf-noop-ck",
                rows=n,
                available_now=True,
            )
            rate_noop = run_to_noop(
                "rate-micro-batch -> noop",
                rate_df(spark, args.max_offsets),
                root / "rate-noop-ck",
                rows=n,
                available_now=False,
            )
            pairs.append((cf_noop, rate_noop))
        table(out, pairs)
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


def table(out: list[str], pairs: list[tuple[Run, Run]]) -> None:
    """One row per run; ``vs rate`` = changefeed changes/s over rate rows/s into the same sink."""
    say(out, "")
    head = (
        f"{'run':<28}{'rows':>11}{'batches':>8}{'seconds':>9}{'changes/s':>12}"
        f"{'vs rate':>9}{'trigger p50':>13}{'p95 (ms)':>10}{'read':>7}{'write':>7}"
    )
    say(out, head)
    say(out, "-" * len(head))
    for ours, theirs in pairs:
        for run in (ours, theirs):
            ratio = run.rate / theirs.rate if theirs.rate else float("nan")
            read = f"{sum(run.collect_s) / run.seconds:.0%}" if run.collect_s else "-"
            write = f"{sum(run.writer_s) / run.seconds:.0%}" if run.writer_s else "-"
            say(
                out,
                f"{run.name:<28}{run.rows:>11,}{run.batches:>8}{run.seconds:>9.1f}"
                f"{run.rate:>12,.0f}{ratio:>9.2f}{percentile(run.trigger_ms, 50):>13,.0f}"
                f"{percentile(run.trigger_ms, 95):>10,.0f}{read:>7}{write:>7}",
            )
    for run in (r for pair in pairs for r in pair):
        if run.note:
            say(out, f"  {run.name}: {run.note}")
        if run.writer_s:
            trigger = ", ".join(f"{ms / 1000:.1f}" for ms in run.trigger_ms)
            read = ", ".join(f"{s:.1f}" for s in run.collect_s)
            writer = ", ".join(f"{s:.1f}" for s in run.writer_s)
            say(
                out,
                f"  {run.name}: s per batch: trigger [{trigger}], read (toArrow) [{read}], "
                f"MirrorWriter.write [{writer}]",
            )


class LatencyProbe:
    """``on_batch`` hook: for each row written inside the window (its write time is the first
    20 bytes of its value; 0 = untimed), (commit time of its batch) - (its write time)."""

    def __init__(self) -> None:
        self.window = (float("inf"), float("inf"))
        self.seconds: list[float] = []

    def __call__(self, table: pa.Table, committed_at: float) -> None:
        if table.num_rows == 0:
            return
        text = pc.cast(table["value"], pa.string())
        written = pc.cast(pc.utf8_slice_codeunits(text, 0, 20), pa.float64()).to_pylist()
        first, last = self.window
        self.seconds.extend(committed_at - w for w in written if first <= w <= last)


def bench_latency(spark: Any, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    """End-to-end latency write -> visible in the mirror, under a steady write rate."""
    root = work / "latency"
    root.mkdir()
    node = start_node(root)
    try:
        say(out, f"\n## latency: {args.latency_rate:,} changes/s for {args.latency_s:.0f} s")
        asyncio.run(_load(node.port, 10_000))  # a mirror to merge into
        rows = [("changefeed -> mirror", changefeed_df(spark, node, args.max_offsets), True)]
        raw = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", args.latency_rate)
            .option("numPartitions", 2)
            .load()
        )
        rows.append(("rate -> mirror", as_change_rows(raw), False))
        head = f"{'run':<28}{'batches':>8}{'trigger p50':>13}{'p95 (ms)':>10}"
        head += f"{'e2e p50':>10}{'p95 (s)':>9}{'changes':>10}{'per s':>9}"
        results = []
        for name, df, writes in rows:
            probe = LatencyProbe()
            trigger_ms = _latency_query(df, root / name[:4], node, probe, writes, args)
            results.append((name, trigger_ms, probe.seconds))
        say(out, "")
        say(out, head)
        say(out, "-" * len(head))
        for name, trigger_ms, seconds in results:
            say(
                out,
                f"{name:<28}{len(trigger_ms):>8}{percentile(trigger_ms, 50):>13,.0f}"
                f"{percentile(trigger_ms, 95):>10,.0f}{percentile(seconds, 50):>10.2f}"
                f"{percentile(seconds, 95):>9.2f}{len(seconds):>10,}"
                f"{len(seconds) / args.latency_s:>9,.0f}",
            )
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


def _latency_query(
    df: Any,
    root: Path,
    node: NodeProcess,
    probe: LatencyProbe,
    writes: bool,
    args: argparse.Namespace,
) -> list[float]:
    """Run ``df`` into a mirror with the default trigger; measure the changes written in a
    window of ``args.latency_s`` after a warm-up (the steady writer runs then, if ``writes``),
    until they reached the mirror; returns triggerExecution ms of the batches meanwhile."""
    writer = TimedWriter(MirrorWriter(root / "tables", node.source_options()), probe)
    query = (
        df.writeStream.foreachBatch(writer)
        .option("checkpointLocation", str(root / "ck"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(_steady_writes(node.port, args.latency_rate, stop)),
        daemon=True,
    )
    try:
        deadline = time.monotonic() + 120
        while writer.batches < 1:  # past the first batch's Python worker start-up; bounded
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, "no batch in 120 s"
            time.sleep(0.05)
        seen = len(query.recentProgress)
        opened = time.time()
        probe.window = (opened, float("inf"))
        if writes:
            thread.start()
        time.sleep(args.latency_s)
        probe.window = (opened, opened + args.latency_s)
        stop.set()
        if writes:
            thread.join(60)
        time.sleep(LATENCY_DRAIN_S)  # the window's last changes reach the mirror
        assert query.exception() is None, query.exception()
        progress = query.recentProgress[seen:]
    finally:
        stop.set()
        query.stop()
    return [float(p["durationMs"]["triggerExecution"]) for p in progress if p["numInputRows"]]


async def _steady_writes(port: int, rate: int, stop: threading.Event) -> None:
    """``rate`` upserts/s in 20 ms windows, values stamped with their write time."""
    tick_s = 0.02
    per_tick = max(1, int(rate * tick_s))
    n = 10_000
    async with await KvClient.connect("127.0.0.1", port) as kv:
        started = time.perf_counter()
        ticks = 0
        while not stop.is_set():  # bounded by the caller's stop
            now = time.time()
            await _upsert(kv, [(key_of(n + i), value_of(n + i, now)) for i in range(per_tick)])
            n += per_tick
            ticks += 1
            await asyncio.sleep(max(0.0, started + ticks * tick_s - time.perf_counter()))


# -- main --------------------------------------------------------------------------------------


def say(out: list[str], line: str) -> None:
    print(line, flush=True)
    out.append(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k changes, short latency run")
    parser.add_argument("--sizes", default="1000000,5000000", help="changes per run, comma list")
    parser.add_argument("--max-offsets", type=int, default=500_000, help="maxOffsetsPerTrigger")
    parser.add_argument("--latency-rate", type=int, default=20_000, help="changes/s written")
    parser.add_argument("--latency-s", type=float, default=30.0)
    parser.add_argument("--no-noop", action="store_true", help="skip the noop-sink rows")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--output", default="", help="default bench/results_spark.txt (full run)")
    args = parser.parse_args()
    if not args.output and not args.quick:
        args.output = str(Path(__file__).with_name("results_spark.txt"))
    if args.quick:
        args.sizes = "100000"
        args.max_offsets = min(args.max_offsets, 50_000)
        args.latency_s = 10.0
    return args


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    out: list[str] = []
    say(out, f"# bench_spark {' '.join(sys.argv[1:])}")
    say(out, f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {platform.node()} {platform.platform()}")
    say(out, f"# {os.cpu_count()} CPUs; python {platform.python_version()}; local[2]; "
             f"{VBUCKETS} vbuckets; maxOffsetsPerTrigger {args.max_offsets:,}")  # fmt: skip
    from changefeed.spark.session import local_session

    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    spark = local_session(
        "bench-spark", driver_memory="6g", spark_sql_streaming_numRecentProgressUpdates="1000"
    )
    import pyspark

    say(out, f"# pyspark {pyspark.__version__}")
    started = time.perf_counter()
    try:
        warm_up(spark, work)
        for n in sizes:
            bench_size(spark, n, args, work, out)
        if not args.no_latency:
            bench_latency(spark, args, work, out)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
        say(out, f"\n# total {time.perf_counter() - started:.0f} s")
        if args.output:
            Path(args.output).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
