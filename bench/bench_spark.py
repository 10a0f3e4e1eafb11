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
* **CPU µs/item**: CPU time (user + system, from ``/proc``) over the run divided by its rows,
  for the Spark side (this driver, its JVM and Python workers) and for the node process; the
  steadier figure on a shared machine, where wall-clock rates move with other jobs' load.
* **mirror write vs table size**: ``MirrorWriter.write`` seconds of the batch that found ~1M
  rows in the mirror and of the last batch (the largest table), to show whether a merge's cost
  grows with the table.
* **latency**: a steady writer (``--latency-rate`` upserts/s, default 2,000, for
  ``--latency-s``) while the stream runs with a short trigger (``--latency-trigger``); each
  value carries its write time, and the end-to-end latency of a change is (commit of its batch)
  - (its write), p50/p95 over every change written in the window (``per s``: the rate actually
  reached). Sinks: the mirror (``MirrorWriter``: changelog and mirror commits) and a bare
  ``foreachBatch`` (``toArrow`` only: the source's share). The rate source's ``timestamp``
  column plays the write time on the other side. Also triggerExecution p50/p95 meanwhile.

* **writer only** (``--writer-only N``, no Spark, no node): ``MirrorWriter.write`` of synthetic
  change rows (10-byte keys, 100-byte values, 64 vbuckets): batches of ``--max-offsets`` new
  keys until the mirror holds N, then 100,000 updates of random keys and 50 updates of keys in
  few vbuckets. Seconds per batch next to the rows the mirror held: does a batch cost more as
  the table grows? Run it with ``PYTHONPATH`` pointing at another checkout to compare writers.

Usage::

    .venv/bin/python bench/bench_spark.py              # 1M and 5M changes
    .venv/bin/python bench/bench_spark.py --quick      # 100k changes
    .venv/bin/python bench/bench_spark.py --sizes 1000000,2000000
    .venv/bin/python bench/bench_spark.py --writer-only 5000000

The full output goes to stdout and to ``bench/results_spark.txt`` (``--output``). Every node
and query the benchmark starts is stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
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


async def load(port: int, count: int) -> None:
    """Upsert keys ``key_of(0..count-1)`` with ``value_of`` values (LOADERS connections, WINDOW
    requests in flight each); also used by ``bench_spark_reader.py``."""

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

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds: user + system, its own and its reaped children's) of
    every live process, from ``/proc/<pid>/stat``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        # After the name: state, ppid, ... utime (14), stime, cutime, cstime (17), 1-based.
        ticks = sum(int(value) for value in fields[11:15])
        out[int(entry)] = (int(fields[1]), ticks / CLOCK_TICKS_PER_S)
    return out


class CpuMeter:
    """CPU seconds used so far by the Spark side (this process and its descendants: the JVM and
    its Python workers) and by the node (its process tree), sampled from ``/proc``. Only the
    difference of two samples means anything (reaped processes move into their parent)."""

    def __init__(self, node_pid: int) -> None:
        self.node_pid = node_pid

    def sample(self) -> tuple[float, float]:
        table = _processes()
        children: dict[int, list[int]] = defaultdict(list)
        for pid, (parent, _) in table.items():
            children[parent].append(pid)

        def tree_s(root: int, skip: int) -> float:
            total = 0.0
            stack = [root]
            while stack:  # bounded: each live pid is visited once
                pid = stack.pop()
                if pid == skip or pid not in table:
                    continue
                total += table[pid][1]
                stack.extend(children[pid])
            return total

        return tree_s(os.getpid(), self.node_pid), tree_s(self.node_pid, -1)

    def settle(self, timeout_s: float = 120.0) -> float:
        """Wait until the node is idle (its flusher done with the load): under 5 % of a core
        over 0.5 s. Returns the seconds waited."""
        started = time.monotonic()
        _, before = self.sample()
        while time.monotonic() - started < timeout_s:  # bounded by the timeout
            time.sleep(0.5)
            _, now = self.sample()
            if now - before < 0.025:
                break
            before = now
        return time.monotonic() - started


class TimedWriter:
    """``foreachBatch`` callable: MirrorWriter plus timing and row counting per batch."""

    def __init__(self, writer: MirrorWriter, on_batch: Callable[[pa.Table, float], None] | None):
        self.writer = writer
        self.on_batch = on_batch
        self.rows = 0
        self.batches = 0
        self.collect_s: list[float] = []
        self.writer_s: list[float] = []
        self.batch_rows: list[int] = []
        self.done_at: float | None = None
        self.done = (0, 0)  # rows and batches when target_rows was reached
        self.target_rows = 0
        self.committed_at: list[tuple[int, float]] = []  # distributed writer: (batch, commit)
        self.phases: list[dict[str, float]] = []  # distributed writer: its timings per batch
        self.in_driver = 0  # batches the distributed writer wrote from the driver
        self.read_in_driver = 0  # of those, batches the driver read from the nodes itself

    def replay_commits(self) -> None:
        """For the distributed writer, once the query stopped: each batch's committed rows
        (read back from the changelog) to ``on_batch`` with the batch's commit time, so the
        probe adds no work to the batches it measures."""
        if self.on_batch is None or not self.committed_at:
            return
        rows = committed_changelog_rows(self.writer.tables)
        for batch_id, at in self.committed_at:
            self.on_batch(rows.filter(pc.equal(rows.column("batch_id"), batch_id)), at)

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        if self.done_at is not None:
            return  # past the target (a rate run before its stop): not timed, not written
        started = time.perf_counter()
        if self.writer.writer == "distributed":  # the read runs in the writer's tasks
            collected = started
            self.writer(batch_df, batch_id)
            count = self.writer.rows_written
            self.phases.append(self.writer.last_timings)
            self.in_driver += self.writer.last_in_driver
            self.read_in_driver += self.writer.last_read_in_driver
            committed_at = time.time()
            if self.on_batch is not None:  # the rows stay in the tasks: read back at the end
                self.committed_at.append((batch_id, committed_at))
        else:
            table = batch_df.toArrow()  # runs the batch: reading the source happens here
            collected = time.perf_counter()
            self.writer.write(table, batch_id)
            count = table.num_rows
            committed_at = time.time()
        finished = time.perf_counter()
        if collected > started:
            self.collect_s.append(collected - started)
        self.writer_s.append(finished - collected)
        self.batch_rows.append(count)
        self.rows += count
        self.batches += 1
        if self.on_batch is not None and self.writer.writer != "distributed":
            self.on_batch(table, committed_at)
        if self.target_rows and self.rows >= self.target_rows and self.done_at is None:
            self.done_at = finished
            self.done = (self.rows, self.batches)


def committed_changelog_rows(tables: str) -> pa.Table:
    """``batch_id`` and ``value`` of the changelog's mutations (the latency probe of the
    distributed writer, whose rows stay in the tasks, reads them once the query stopped)."""
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    dataset = DeltaTable(f"{tables}/changelog").to_pyarrow_dataset()
    return dataset.to_table(columns=["batch_id", "value"], filter=ds.field("op") == "mutation")


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
    spark_cpu_s: float = 0.0
    node_cpu_s: float = 0.0
    batch_rows: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # durationMs sums, seconds

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    def cpu_us(self, seconds: float) -> float:
        return seconds / self.rows * 1e6 if self.rows else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def changefeed_df(spark: Any, node: NodeProcess, max_offsets: int, partitions: int = 2) -> Any:
    options = node.source_options(
        maxOffsetsPerTrigger=str(max_offsets), partitions=str(partitions), format="binary"
    )  # the values are not JSON: change rows with the document as bytes, as rate's
    return spark.readStream.format("changefeed").options(**options).load()


def rate_df(spark: Any, rows_per_batch: int, partitions: int = 2) -> Any:
    raw = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", rows_per_batch)
        .option("numPartitions", partitions)
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
    cpu: CpuMeter,
    writer_kind: str = "local",
) -> Run:
    """Run ``df -> foreachBatch(MirrorWriter)``: availableNow to the end, or until ``rows``.
    ``writer_kind``: the local writer (the batch collected with ``toArrow``, written by the
    driver) or the distributed one (Spark's tasks write the files)."""
    writer = TimedWriter(mirror_writer(tables, options, writer_kind), None)
    writer.target_rows = rows
    stream = df.writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint))
    if available_now:
        stream = stream.trigger(availableNow=True)
    cpu_before = cpu.sample()
    started = time.perf_counter()
    query = stream.start()
    try:
        if available_now:
            assert query.awaitTermination(QUERY_DEADLINE_S), f"{name}: no end in time"
            # The last commit, as for the rate runs (not when the query noticed it was done).
            ended = writer.done_at if writer.done_at is not None else time.perf_counter()
        else:
            deadline = time.monotonic() + QUERY_DEADLINE_S
            while writer.done_at is None:  # bounded by the deadline
                assert query.exception() is None, query.exception()
                assert time.monotonic() < deadline, f"{name}: {writer.rows} rows only"
                time.sleep(0.02)
            ended = writer.done_at
        cpu_after = cpu.sample()
        if not available_now:
            while len(_with_rows(query)) < writer.done[1] and time.monotonic() < deadline:
                time.sleep(0.02)  # the last batch's progress comes after its checkpoint commit
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    trigger_ms = [float(p["durationMs"]["triggerExecution"]) for p in _with_rows(query)]
    rows, batches = writer.done if writer.done_at is not None else (writer.rows, writer.batches)
    phases: dict[str, float] = defaultdict(float)  # Spark's durationMs, summed over the batches
    for progress in _with_rows(query)[:batches]:
        for phase, ms in progress["durationMs"].items():
            phases[phase] += float(ms) / 1000
    return Run(
        name,
        rows,
        ended - started,
        batches,
        trigger_ms[:batches],
        writer.collect_s[:batches],
        writer.writer_s[:batches],
        spark_cpu_s=cpu_after[0] - cpu_before[0],
        node_cpu_s=cpu_after[1] - cpu_before[1],
        batch_rows=writer.batch_rows[:batches],
        phases=dict(phases),
    )


def _with_rows(query: Any) -> list[Any]:
    return [p for p in query.recentProgress if p["numInputRows"] > 0]


def run_to_noop(
    name: str, df: Any, checkpoint: Path, *, rows: int, available_now: bool, cpu: CpuMeter
) -> Run:
    stream = df.writeStream.format("noop").option("checkpointLocation", str(checkpoint))
    if available_now:
        stream = stream.trigger(availableNow=True)
    cpu_before = cpu.sample()
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
        cpu_after = cpu.sample()
    finally:
        query.stop()
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    done = sum(p["numInputRows"] for p in progress)
    trigger_ms = [float(p["durationMs"]["triggerExecution"]) for p in progress]
    return Run(
        name, done, ended - started, len(progress), trigger_ms,
        spark_cpu_s=cpu_after[0] - cpu_before[0], node_cpu_s=cpu_after[1] - cpu_before[1],
    )  # fmt: skip


# -- the runs ----------------------------------------------------------------------------------


def warm_up(spark: Any, work: Path) -> None:
    """One small run of each kind first: JIT, Python worker pools, Delta code paths."""
    root = work / "warm-up"
    root.mkdir()
    node = start_node(root)
    cpu = CpuMeter(node.pid)
    try:
        asyncio.run(load(node.port, 20_000))
        run_to_mirror(
            "warm-up", changefeed_df(spark, node, 10_000), root / "t1", root / "c1",
            node.source_options(), rows=20_000, available_now=True, cpu=cpu,
        )  # fmt: skip
        run_to_mirror(
            "warm-up", rate_df(spark, 10_000), root / "t2", root / "c2",
            node.source_options(), rows=20_000, available_now=False, cpu=cpu,
        )  # fmt: skip
        run_to_mirror(
            "warm-up", changefeed_df(spark, node, 10_000), root / "t3", root / "c3",
            node.source_options(), rows=20_000, available_now=True, cpu=cpu,
            writer_kind="distributed",
        )  # fmt: skip
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


def bench_size(spark: Any, n: int, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    root = work / f"n{n}"
    root.mkdir()
    node = start_node(root)
    cpu = CpuMeter(node.pid)
    try:
        started = time.perf_counter()
        asyncio.run(load(node.port, n))
        load_s = time.perf_counter() - started
        settle_s = cpu.settle()
        say(
            out,
            f"\n## N = {n:,} changes (load: {load_s:.1f} s, {n / load_s:,.0f} upserts/s; "
            f"node idle {settle_s:.1f} s later)",
        )

        pairs = []
        for kind in args.mirror_writers.split(","):
            cf = run_to_mirror(
                f"changefeed -> mirror [{kind}]",
                changefeed_df(spark, node, args.max_offsets),
                root / f"cf-tables-{kind}",
                root / f"cf-ck-{kind}",
                node.source_options(),
                rows=n,
                available_now=True,
                cpu=cpu,
                writer_kind=kind,
            )
            mirror = read_mirror(root / f"cf-tables-{kind}")
            bad = asyncio.run(_sample_matches(node.port, mirror, random.Random(n)))
            assert mirror.num_rows == n, (mirror.num_rows, n)
            assert bad == 0, f"{bad} of {SAMPLE_KEYS} sampled keys differ from the node"
            cf.note = f"mirror rows {mirror.num_rows:,}, {SAMPLE_KEYS} sampled keys equal the node"
            del mirror
            shutil.rmtree(root / f"cf-tables-{kind}")

            rate = run_to_mirror(
                f"rate-micro-batch -> mirror [{kind}]",
                rate_df(spark, args.max_offsets),
                root / f"rate-tables-{kind}",
                root / f"rate-ck-{kind}",
                node.source_options(),
                rows=n,
                available_now=False,
                cpu=cpu,
                writer_kind=kind,
            )
            rate_rows = read_mirror(root / f"rate-tables-{kind}").num_rows
            rate.note = f"mirror rows {rate_rows:,}"
            shutil.rmtree(root / f"rate-tables-{kind}")
            pairs.append((cf, rate))
        if not args.no_noop:
            cf_noop = run_to_noop(
                "changefeed -> noop",
                changefeed_df(spark, node, args.max_offsets),
                root / "cf-noop-ck",
                rows=n,
                available_now=True,
                cpu=cpu,
            )
            rate_noop = run_to_noop(
                "rate-micro-batch -> noop",
                rate_df(spark, args.max_offsets),
                root / "rate-noop-ck",
                rows=n,
                available_now=False,
                cpu=cpu,
            )
            pairs.append((cf_noop, rate_noop))
        table(out, pairs)
        say(out, f"  load average after the runs: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


def table(out: list[str], pairs: list[tuple[Run, Run]]) -> None:
    """One row per run; ``vs rate`` = changefeed changes/s over rate rows/s into the same sink."""
    say(out, "")
    head = (
        f"{'run':<42}{'rows':>11}{'batches':>8}{'seconds':>9}{'changes/s':>12}"
        f"{'vs rate':>9}{'trigger p50':>13}{'p95 (ms)':>10}{'read':>7}{'write':>7}"
        f"{'cpu µs/item: spark':>20}{'node':>7}"
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
                f"{run.name:<42}{run.rows:>11,}{run.batches:>8}{run.seconds:>9.1f}"
                f"{run.rate:>12,.0f}{ratio:>9.2f}{percentile(run.trigger_ms, 50):>13,.0f}"
                f"{percentile(run.trigger_ms, 95):>10,.0f}{read:>7}{write:>7}"
                f"{run.cpu_us(run.spark_cpu_s):>20.1f}{run.cpu_us(run.node_cpu_s):>7.1f}",
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
            if run.phases:  # where the triggers went: planning (latestOffset) vs the batch
                shown = ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(run.phases.items()) if v >= 0.05
                )
                untimed = run.seconds - run.phases.get("triggerExecution", 0.0)
                say(out, f"  {run.name}: Spark durationMs summed (s): {shown}; outside "
                         f"triggers (query start, stop) {untimed:.1f}")  # fmt: skip
            growth = write_growth(run)
            if growth:
                say(out, f"  {run.name}: {growth}")


def write_growth(run: Run) -> str:
    """``MirrorWriter.write`` of the first batch that found >= 1M rows in the mirror next to
    the last batch's (the largest table); empty when no batch found 1M."""
    held = 0
    first: tuple[int, float] | None = None
    for rows, seconds in zip(run.batch_rows, run.writer_s, strict=True):
        if held >= 1_000_000 and first is None:
            first = (held, seconds)
        last = (held, seconds)
        held += rows
    if first is None or first == last:
        return ""
    return (
        f"MirrorWriter.write with {first[0] / 1e6:.1f}M rows in the mirror {first[1]:.2f} s, "
        f"with {last[0] / 1e6:.1f}M rows {last[1]:.2f} s ({last[1] / first[1]:.2f}x)"
    )


# ``--mirror-writers`` kinds may end in modifiers, each ``:name``: the writer's option they set.
KIND_MODIFIERS = {
    "sparkread": ("mirrorDriverRead", "false"),  # the driver path collects with toArrow
    **{f"g{n}": ("mirrorGroups", str(n)) for n in (1, 2, 4, 8, 16, 32)},
}


def mirror_writer(tables: Path, options: dict[str, str], kind: str) -> MirrorWriter:
    """``kind``: ``local`` (toArrow + the driver's delta-rs writer), ``distributed`` (every
    batch in Spark's write tasks) or ``adaptive`` (the distributed writer's default: batches
    planned at most ``mirrorDriverBatchMax`` changes written from the driver, which reads
    them from the nodes itself), with ``KIND_MODIFIERS`` after ``:`` (``adaptive:sparkread:g4``)."""
    spec = kind
    kind, *modifiers = kind.split(":")
    unknown = [m for m in modifiers if m not in KIND_MODIFIERS]
    if unknown:
        raise SystemExit(
            f"--mirror-writers: unknown modifier {', '.join(map(repr, unknown))} in {spec!r} "
            f"(known: {', '.join(KIND_MODIFIERS)})"
        )
    options = {**options, **dict(KIND_MODIFIERS[m] for m in modifiers)}
    if kind == "adaptive":
        return MirrorWriter(tables, options, writer="distributed")
    if kind == "distributed":
        return MirrorWriter(tables, {**options, "mirrorDriverBatchMax": "0"}, writer=kind)
    return MirrorWriter(tables, options, writer=kind)


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
    """End-to-end latency write -> committed by the sink, under a steady write rate."""
    root = work / "latency"
    root.mkdir()
    node = start_node(root)
    cpu = CpuMeter(node.pid)
    try:
        say(
            out,
            f"\n## latency: {args.latency_rate:,} changes/s for {args.latency_s:.0f} s, "
            f"trigger processingTime {args.latency_trigger!r}",
        )
        asyncio.run(load(node.port, 10_000))  # a mirror to merge into
        options = node.source_options()
        kinds = args.mirror_writers.split(",")

        def writer_of(kind: str) -> Callable[[Path], Any]:
            return lambda at: mirror_writer(at / "tables", options, kind)

        rows: list[tuple[str, Any, bool, Callable[[Path], Any]]] = [
            (f"changefeed -> mirror [{kind}]", changefeed_df(spark, node, args.max_offsets),
             True, writer_of(kind))
            for kind in kinds
        ]  # fmt: skip
        rows.append(
            ("changefeed -> foreachBatch", changefeed_df(spark, node, args.max_offsets), True,
             lambda at: None)
        )  # fmt: skip
        for kind in kinds:
            if ":" in kind:
                continue  # rate's rows for the plain writers only
            raw = (
                spark.readStream.format("rate")
                .option("rowsPerSecond", args.latency_rate)
                .option("numPartitions", 2)
                .load()
            )
            rows.append(
                (f"rate -> mirror [{kind}]", as_change_rows(raw), False, writer_of(kind))
            )  # fmt: skip
        head = f"{'run':<36}{'batches':>8}{'trigger p50':>13}{'p95 (ms)':>10}"
        head += f"{'e2e p50':>10}{'p95 (s)':>9}{'changes':>10}{'per s':>9}"
        head += f"{'cpu µs/item: spark':>20}{'node':>7}{'write p50 (ms)':>16}"
        results = []
        notes: list[str] = []
        for i, (name, df, writes, make_writer) in enumerate(rows):
            probe = LatencyProbe()
            at = root / f"q{i}"
            used_before = cpu.sample()
            trigger_ms, write_s, phases = _latency_query(
                df, at, make_writer(at), probe, node, writes, args
            )
            used = [after - before for after, before in zip(cpu.sample(), used_before, strict=True)]
            results.append((name, trigger_ms, probe.seconds, used, write_s))
            shown = ", ".join(f"{k} {v:,.0f}" for k, v in phases.items() if v >= 1)
            notes.append(f"  {name}: Spark durationMs p50 per batch (ms): {shown}")
        say(out, "")
        say(out, head)
        say(out, "-" * len(head))
        for name, trigger_ms, seconds, (spark_s, node_s), write_s in results:
            per_item = 1e6 / len(seconds) if seconds else float("nan")
            say(
                out,
                f"{name:<36}{len(trigger_ms):>8}{percentile(trigger_ms, 50):>13,.0f}"
                f"{percentile(trigger_ms, 95):>10,.0f}{percentile(seconds, 50):>10.2f}"
                f"{percentile(seconds, 95):>9.2f}{len(seconds):>10,}"
                f"{len(seconds) / args.latency_s:>9,.0f}"
                f"{spark_s * per_item:>20.1f}{node_s * per_item:>7.1f}"
                f"{percentile(write_s, 50) * 1000 if write_s else float('nan'):>16,.0f}",
            )
        say(out, "  cpu µs/item here: the whole query's CPU (polling and per-batch cost included)")
        say(out, "  write p50: MirrorWriter.write per batch (changelog and mirror commits)")
        for note in notes:
            say(out, note)
        say(out, f"  load average after the runs: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        node.stop(check=False)
        shutil.rmtree(root, ignore_errors=True)


class BareSink:
    """``foreachBatch`` callable that only runs the batch (``toArrow``): the source's share of
    the latency, without the Delta commits."""

    def __init__(self, on_batch: Callable[[pa.Table, float], None]) -> None:
        self.on_batch = on_batch
        self.batches = 0

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        table = batch_df.toArrow()
        self.batches += 1
        self.on_batch(table, time.time())


def _latency_query(
    df: Any,
    root: Path,
    mirror: MirrorWriter | None,
    probe: LatencyProbe,
    node: NodeProcess,
    writes: bool,
    args: argparse.Namespace,
) -> tuple[list[float], list[float], dict[str, float]]:
    """Run ``df`` into ``mirror`` (None: a bare foreachBatch) with a short trigger; measure the
    changes written in a window of ``args.latency_s`` after a warm-up (the steady writer runs
    then, if ``writes``), until they reached the sink; returns triggerExecution ms and
    ``MirrorWriter.write`` seconds (none for the bare sink) of the batches meanwhile, and the
    p50 of each of Spark's ``durationMs`` phases."""
    sink: TimedWriter | BareSink = BareSink(probe) if mirror is None else TimedWriter(mirror, probe)
    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(root / "ck"))
        .trigger(processingTime=args.latency_trigger)
        .start()
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(_steady_writes(node.port, args.latency_rate, stop)),
        daemon=True,
    )
    try:
        deadline = time.monotonic() + 120
        while sink.batches < 1:  # past the first batch's Python worker start-up; bounded
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, "no batch in 120 s"
            time.sleep(0.05)
        seen = len(query.recentProgress)
        seen_writes = len(sink.writer_s) if isinstance(sink, TimedWriter) else 0
        opened = time.time()
        probe.window = (opened, float("inf"))
        if writes:
            thread.start()
        time.sleep(args.latency_s)
        probe.window = (opened, opened + args.latency_s)
        stop.set()
        if writes:
            thread.join(60)
        time.sleep(LATENCY_DRAIN_S)  # the window's last changes reach the sink
        assert query.exception() is None, query.exception()
        progress = query.recentProgress[seen:]
    finally:
        stop.set()
        query.stop()
    if isinstance(sink, TimedWriter):
        sink.replay_commits()
    batches = [p for p in progress if p["numInputRows"]]
    trigger_ms = [float(p["durationMs"]["triggerExecution"]) for p in batches]
    write_s = sink.writer_s[seen_writes:] if isinstance(sink, TimedWriter) else []
    phases = {
        phase: percentile([float(p["durationMs"].get(phase, 0)) for p in batches], 50)
        for phase in sorted({k for p in batches for k in p["durationMs"]})
    }  # Spark's durationMs, p50 per phase: where a batch's time goes
    if isinstance(sink, TimedWriter) and sink.phases[seen_writes:]:
        ours = sink.phases[seen_writes:]
        for phase in sorted({k for p in ours for k in p}):
            phases[f"writer {phase}"] = 1000 * percentile([p.get(phase, 0.0) for p in ours], 50)
        phases["writer batches from the driver"] = sink.in_driver
        phases["writer batches read by the driver"] = sink.read_in_driver
    return trigger_ms, write_s, phases


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


def synthetic_changes(first: int, last: int, seqno_base: int = 0) -> pa.Table:
    """Change rows (mutations) of keys ``key_of(first..last-1)``, 100-byte values."""
    import numpy as np

    from changefeed.spark.schema import ARROW_SCHEMA

    n = np.arange(first, last, dtype=np.int64)
    count = last - first
    keys = pa.array([key_of(i) for i in range(first, last)], pa.binary()).cast(pa.string())
    return pa.table(
        {
            "vbucket": pa.array((n * 2654435761 % VBUCKETS).astype(np.int32)),
            "seqno": pa.array(n + 1 + seqno_base),
            "key": keys,
            "value": pa.array([value_of(i) for i in range(first, last)], pa.binary()),
            "op": pa.array(["mutation"] * count, pa.string()),
            "cas": pa.array(n + 1 + seqno_base),
            "expiry": pa.array(np.zeros(count, np.int32)),
            "flags": pa.array(np.zeros(count, np.int32)),
            "rev_seqno": pa.array(np.ones(count, np.int64)),
            "snap_start": pa.array(n + 1 + seqno_base),
            "snap_end": pa.array(n + 1 + seqno_base),
        },
        schema=ARROW_SCHEMA,
    )


def bench_writer(total: int, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    """``MirrorWriter.write`` alone (see the module docstring, *writer only*)."""
    step = args.max_offsets
    writer = MirrorWriter(work / "writer-only", {"cluster": "127.0.0.1:1"})  # no rollback rows
    say(out, f"\n## MirrorWriter.write alone: {step:,} new keys a batch up to {total:,} rows")
    say(out, f"{'rows in mirror':>15}{'batch':>10}{'seconds':>9}")
    batch_id = 0
    for first in range(0, total, step):
        changes = synthetic_changes(first, min(first + step, total))
        started = time.perf_counter()
        writer.write(changes, batch_id)
        say(out, f"{first:>15,}{changes.num_rows:>10,}{time.perf_counter() - started:>9.2f}")
        batch_id += 1
    rng = random.Random(total)
    for name, picks in (
        ("random updates", sorted(rng.sample(range(total), min(100_000, total)))),
        ("updates in few vbuckets", list(range(0, total, max(1, total // 50)))),
    ):
        everything = synthetic_changes(0, total, seqno_base=10 * total * (batch_id + 1))
        changes = everything.take(pa.array(picks))
        started = time.perf_counter()
        writer.write(changes, batch_id)
        elapsed = time.perf_counter() - started
        say(out, f"{total:>15,}{changes.num_rows:>10,}{elapsed:>9.2f}  {name}")
        batch_id += 1
    assert read_mirror(work / "writer-only").num_rows == total


# -- a standalone cluster on this machine -----------------------------------------------------


def standalone_cluster(work: Path, workers: int = 2) -> Any:
    """A master and ``workers`` workers of 1 core each (``tests/spark/standalone.py``: each a
    ``spark-class`` process group of this process, stopped by pid in its ``stop``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from spark.standalone import Standalone  # type: ignore[import-not-found]

    return Standalone(work / "standalone", workers=workers, cores=1, memory="3g").start()


def cluster_session(url: str, executors: int, name: str, driver_memory: str = "2g") -> Any:
    """A session on the standalone master using ``executors`` executors of 1 core."""
    from changefeed.spark.session import spark_session

    return spark_session(name, url, {
        "spark.cores.max": str(executors), "spark.executor.memory": "2g",
        "spark.driver.memory": driver_memory,
        "spark.sql.streaming.numRecentProgressUpdates": "1000",
    })  # fmt: skip


def executor_count(spark: Any) -> int:
    """Executors registered with the driver (the driver itself not counted)."""
    return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1


def bench_standalone(n: int, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    """The mirror on a standalone cluster with 1 and 2 executors (1 core each): changefeed ->
    mirror [distributed] next to rate-micro-batch -> the same writer, each in the same session,
    read tasks = the executors' cores (the source's ``partitions`` and rate's
    ``numPartitions``). A small warm-up of both first in each session (executor start-up,
    Python workers). The table's ``vs rate`` is per session; the summary line gives each
    source's 2-executor rate over its 1-executor rate."""
    say(out, f"# bench_spark {' '.join(sys.argv[1:])}")
    say(out, f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {platform.node()}; {os.cpu_count()} CPUs; "
             f"standalone: master + 2 workers of 1 core; {VBUCKETS} vbuckets; "
             f"maxOffsetsPerTrigger {args.max_offsets:,}")  # fmt: skip
    cluster = standalone_cluster(work)
    node = start_node(work / "node")
    warm = start_node(work / "warm-node")
    try:
        started = time.perf_counter()
        asyncio.run(load(warm.port, 20_000))
        asyncio.run(load(node.port, n))
        load_s = time.perf_counter() - started
        cpu = CpuMeter(node.pid)
        settle_s = cpu.settle()
        say(out, f"\n## standalone: N = {n:,} changes (load {load_s:.1f} s; node idle "
                 f"{settle_s:.1f} s later)")  # fmt: skip
        pairs: list[tuple[Run, Run]] = []
        for executors in (1, 2):
            spark = cluster_session(cluster.url, executors, f"bench-standalone-{executors}")
            try:
                at = work / f"e{executors}"
                kind = "distributed"
                for i, df in enumerate((changefeed_df(spark, warm, 10_000, executors),
                                        rate_df(spark, 10_000, executors))):  # fmt: skip
                    run_to_mirror(
                        "warm-up", df, at / f"warm-t{i}", at / f"warm-c{i}", warm.source_options(),
                        rows=20_000, available_now=i == 0, cpu=cpu, writer_kind=kind,
                    )  # fmt: skip
                assert executor_count(spark) == executors, executor_count(spark)
                cf = run_to_mirror(
                    f"changefeed -> mirror, {executors} executor(s)",
                    changefeed_df(spark, node, args.max_offsets, executors),
                    at / "cf-t", at / "cf-c", node.source_options(), rows=n,
                    available_now=True, cpu=cpu, writer_kind=kind,
                )  # fmt: skip
                rows = read_mirror(at / "cf-t").num_rows
                assert rows == n, (rows, n)
                cf.note = f"mirror rows {rows:,}"
                rate = run_to_mirror(
                    f"rate -> mirror, {executors} executor(s)",
                    rate_df(spark, args.max_offsets, executors),
                    at / "rate-t", at / "rate-c", node.source_options(), rows=n,
                    available_now=False, cpu=cpu, writer_kind=kind,
                )  # fmt: skip
                pairs.append((cf, rate))
            finally:
                spark.stop()
                shutil.rmtree(work / f"e{executors}", ignore_errors=True)
        table(out, pairs)
        (cf1, rate1), (cf2, rate2) = pairs
        say(out, f"  2 executors / 1: changefeed {cf2.rate / cf1.rate:.2f}x, rate "
                 f"{rate2.rate / rate1.rate:.2f}x")  # fmt: skip
        say(out, f"  load average after the runs: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        node.stop(check=False)
        warm.stop(check=False)
        cluster.stop()


MEMORY_BATCHES = (250_000, 1_000_000, 2_500_000)


def bench_driver_memory(n: int, args: argparse.Namespace, work: Path, out: list[str]) -> None:
    """Peak RSS of the driver (its JVM and its Python process) mirroring ``n`` changes from a
    node on a standalone cluster of 2 executors, with ``maxOffsetsPerTrigger`` 250k, 1M and
    2.5M, for each writer of ``--mirror-writers``. Each run is a fresh driver (a child process
    of this one: ``--memory-child``), so each peak is its own; the executors are the cluster's
    (their memory is not the driver's)."""
    say(out, f"# bench_spark {' '.join(sys.argv[1:])}")
    say(out, f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {platform.node()}; {os.cpu_count()} CPUs; "
             f"standalone: master + 2 workers of 1 core; {VBUCKETS} vbuckets")  # fmt: skip
    cluster = standalone_cluster(work)
    node = start_node(work / "node")
    try:
        started = time.perf_counter()
        asyncio.run(load(node.port, n))
        load_s = time.perf_counter() - started
        settle_s = CpuMeter(node.pid).settle()
        say(out, f"\n## driver memory: N = {n:,} changes, 2 executors (load {load_s:.1f} s; "
                 f"node idle {settle_s:.1f} s later); driver spark.driver.memory 4g")  # fmt: skip
        head = (f"{'writer':<13}{'batch':>11}{'batches':>8}{'seconds':>9}{'changes/s':>11}"
                f"{'driver JVM peak MiB':>21}{'driver Python peak MiB':>24}")  # fmt: skip
        say(out, "")
        say(out, head)
        say(out, "-" * len(head))
        for kind in args.mirror_writers.split(","):
            for batch in MEMORY_BATCHES:
                spec = {"url": cluster.url, "port": node.port, "address": node.address,
                        "batch": batch, "writer": kind, "n": n,
                        "work": str(work / f"m-{kind}-{batch}")}  # fmt: skip
                done = subprocess.run(
                    [sys.executable, __file__, "--memory-child", json.dumps(spec)],
                    capture_output=True, text=True, timeout=QUERY_DEADLINE_S, check=False,
                )  # fmt: skip
                lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
                if done.returncode or not lines:
                    say(out, f"{kind:<13}{batch:>11,}  failed: {done.stderr.strip()[-400:]}")
                    continue
                got = json.loads(lines[-1])
                say(out, f"{kind:<13}{batch:>11,}{got['batches']:>8}{got['seconds']:>9.1f}"
                         f"{n / got['seconds']:>11,.0f}{got['jvm_mib']:>21,.0f}"
                         f"{got['python_mib']:>24,.0f}")  # fmt: skip
                shutil.rmtree(spec["work"], ignore_errors=True)
        say(out, "  peak RSS: VmHWM of the driver's JVM and of the driver's Python process")
        say(out, f"  load average after the runs: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        node.stop(check=False)
        cluster.stop()


def memory_child(spec: dict[str, Any]) -> None:
    """One driver of ``bench_driver_memory``: mirror the node, print a JSON line of its
    seconds and peak RSS (this process, and the JVM it started)."""
    work = Path(spec["work"])
    spark = cluster_session(spec["url"], 2, "bench-driver-memory", driver_memory="4g")
    try:
        options = {"cluster": spec["address"]}
        df = spark.readStream.format("changefeed").options(
            maxOffsetsPerTrigger=str(spec["batch"]), partitions="2", format="binary", **options
        ).load()  # fmt: skip
        writer = TimedWriter(mirror_writer(work / "t", options, spec["writer"]), None)
        query = (df.writeStream.foreachBatch(writer).trigger(availableNow=True)
                 .option("checkpointLocation", str(work / "c")).start())  # fmt: skip
        started = time.perf_counter()
        assert query.awaitTermination(QUERY_DEADLINE_S), "no end in time"
        seconds = time.perf_counter() - started
        assert query.exception() is None, query.exception()
        assert writer.rows == spec["n"], (writer.rows, spec["n"])
        jvm = max((_peak_rss_mib(pid) for pid in _descendants(os.getpid())
                   if _command(pid) == "java"), default=0.0)  # fmt: skip
        print(json.dumps({"seconds": seconds, "batches": writer.batches, "jvm_mib": jvm,
                          "python_mib": _peak_rss_mib(os.getpid())}), flush=True)  # fmt: skip
    finally:
        spark.stop()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in _processes().items():
        children[parent].append(pid)
    out, stack = [], [root]
    while stack:  # bounded: each live pid once
        pid = stack.pop()
        out.append(pid)
        stack.extend(children[pid])
    return out[1:]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _peak_rss_mib(pid: int) -> float:
    """VmHWM (peak resident set) of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


TYPED_FIELDS = 10
TYPED_DDL = (
    "id bigint, amount double, qty bigint, status string, customer string, city string, "
    "paid boolean, score double, created string, note string"
)


def typed_document(n: int) -> bytes:
    """A JSON document of ``TYPED_FIELDS`` fields (~200 bytes): numbers, strings, a boolean."""
    return (
        b'{"id":%d,"amount":%d.%02d,"qty":%d,"status":"%s","customer":"customer-%07d",'
        b'"city":"city-%03d","paid":%s,"score":%d.5,"created":"2026-11-%02dT10:00:00Z",'
        b'"note":"order %d of a steady stream"}'
        % (n, n % 10_000, n % 100, n % 17, (b"new", b"paid", b"shipped")[n % 3], n % 1_000_000,
           n % 500, (b"true", b"false")[n % 2], n % 1000, n % 28 + 1, n)
    )  # fmt: skip


async def _load_typed(port: int, count: int) -> None:
    async def one(first: int, last: int) -> None:
        async with await KvClient.connect("127.0.0.1", port) as kv:
            for start in range(first, last, WINDOW):
                end = min(start + WINDOW, last)
                await _upsert(kv, [(key_of(n), typed_document(n)) for n in range(start, end)])

    bounds = [count * i // LOADERS for i in range(LOADERS + 1)]
    await asyncio.gather(*(one(bounds[i], bounds[i + 1]) for i in range(LOADERS)))


def bench_typed(n: int, work: Path, out: list[str]) -> None:
    """Typed columns from the node (``spark.read.format("changefeed")``, the documents parsed
    in the reader) next to Spark's JSON reader over the same documents as JSON lines, both
    into the noop sink, in one session; best of ``TYPED_RUNS`` each (the first pays worker
    start-up). Three pairs, each side given the same work: the schema given to both; the
    schema inferred from the same number of documents (changefeed: ``inferSchemaSamples`` per
    vbucket; Spark: ``samplingRatio`` = that many / n: it still reads the whole file, and
    parses only the sample); inferred from every document (``inferSchemaSamples`` past any
    vbucket's size; ``samplingRatio`` 1). Each pair is then checked value by value, not by
    count alone: same inferred fields and types, and each side's rows minus the other's
    (``exceptAll``, both ways) empty. The first read waits for the node's flusher to finish
    with the load (``CpuMeter.settle``); each row also gives CPU µs per document (Spark side:
    this driver, the JVM, its Python workers; and the node) of its best run, and the load
    average after the runs."""
    from changefeed.spark.session import local_session

    when = time.strftime("%Y-%m-%d %H:%M:%S")
    say(out, f"# bench_spark --typed {n}: {when} {platform.node()}; {os.cpu_count()} CPUs; "
             f"local[2]; {VBUCKETS} vbuckets")  # fmt: skip
    node = start_node(work / "node")
    spark = local_session("bench-typed", driver_memory="4g")
    try:
        started = time.perf_counter()
        asyncio.run(_load_typed(node.port, n))
        lines = work / "docs.jsonl"
        with open(lines, "wb") as handle:
            for start in range(0, n, 100_000):
                handle.write(
                    b"".join(
                        typed_document(i) + b"\n" for i in range(start, min(n, start + 100_000))
                    )
                )
        loaded = time.perf_counter() - started
        cpu = CpuMeter(node.pid)
        settled = cpu.settle()  # the flusher done with the load: it would slow the first read
        say(out, f"\n## typed columns: {n:,} JSON documents of {TYPED_FIELDS} fields "
                 f"({lines.stat().st_size / n:.0f} bytes each; load {loaded:.0f} s, "
                 f"settle {settled:.0f} s)")  # fmt: skip
        options = node.source_options(partitions="2")
        sample = min(n, TYPED_SAMPLES * VBUCKETS)
        ratio = sample / n
        every = str(n)  # past any vbucket's size: every document
        pairs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
            ("schema given",
             lambda: spark.read.format("changefeed").options(schema=TYPED_DDL, **options).load(),
             lambda: spark.read.schema(TYPED_DDL).json(str(lines))),
            (f"inferred from {sample:,}",
             lambda: spark.read.format("changefeed")
             .options(inferSchemaSamples=str(TYPED_SAMPLES), **options).load(),
             lambda: spark.read.option("samplingRatio", str(ratio)).json(str(lines))),
            ("inferred from all",
             lambda: spark.read.format("changefeed")
             .options(inferSchemaSamples=every, **options).load(),
             lambda: spark.read.option("samplingRatio", "1.0").json(str(lines))),
        ]  # fmt: skip
        for kind, ours, theirs in pairs:
            best = {}
            for side, make in (("changefeed", ours), ("spark.read.json", theirs)):
                best[side] = _best_typed_run(f"{side}, {kind}", make, n, cpu, out)
            say(out, f"  ratio ({kind}): {best['spark.read.json'] / best['changefeed']:.2f}x "
                     "spark.read.json (goal >= 0.8x)")  # fmt: skip
            say(out, f"  values ({kind}): {_compare_typed(ours(), theirs(), n)}")
    finally:
        spark.stop()
        node.stop(check=False)


def _best_typed_run(name: str, make: Callable[[], Any], n: int, cpu: CpuMeter,
                    out: list[str]) -> float:  # fmt: skip
    """``TYPED_RUNS`` reads of ``make()`` into the noop sink; prints the best; its seconds."""
    times: list[tuple[float, float, float]] = []  # seconds, CPU µs/doc Spark and node
    for _ in range(TYPED_RUNS):
        cpu_before = cpu.sample()
        begun = time.perf_counter()
        make().write.format("noop").mode("overwrite").save()  # the schema is inferred here too
        seconds = time.perf_counter() - begun
        cpu_after = cpu.sample()
        times.append((seconds, *((a - b) * 1e6 / n for a, b in
                                 zip(cpu_after, cpu_before, strict=True))))  # fmt: skip
    best = min(times)
    say(out, f"  {name:<40} best {best[0]:6.2f} s  ({n / best[0]:>10,.0f} docs/s)  "
             f"CPU µs/doc Spark {best[1]:.2f} node {best[2]:.2f}  "
             f"runs {', '.join(f'{t[0]:.2f}' for t in times)}  "
             f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    return best[0]


def _compare_typed(ours: Any, theirs: Any, n: int) -> str:
    """The documents' fields of both reads (changefeed's metadata columns left out): the same
    names and types, and the same rows, value by value (``exceptAll`` both ways, so a row
    twice on one side counts). Raises AssertionError on a difference."""
    fields = [f for f in theirs.schema.fields if f.name != "_corrupt_record"]
    mine = {f.name: f.dataType.simpleString() for f in ours.schema.fields}
    wrong = [(f.name, mine.get(f.name), f.dataType.simpleString()) for f in fields
             if mine.get(f.name) != f.dataType.simpleString()]  # fmt: skip
    assert not wrong, f"fields differ (name, changefeed, spark): {wrong}"
    names = [f.name for f in fields]
    a, b = ours.select(*names), theirs.select(*names)
    rows = a.count(), b.count()
    assert rows == (n, n), rows
    only_ours, only_theirs = a.exceptAll(b).count(), b.exceptAll(a).count()
    assert only_ours == only_theirs == 0, (only_ours, only_theirs)
    return f"{n:,} rows x {len(names)} fields equal (same types; exceptAll both ways empty)"


TYPED_SAMPLES = 100  # changefeed's inferSchemaSamples default, per vbucket
TYPED_RUNS = 3


def say(out: list[str], line: str) -> None:
    print(line, flush=True)
    out.append(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k changes, short latency run")
    parser.add_argument("--sizes", default="1000000,5000000", help="changes per run, comma list")
    parser.add_argument("--max-offsets", type=int, default=500_000, help="maxOffsetsPerTrigger")
    parser.add_argument("--latency-rate", type=int, default=2_000, help="changes/s written")
    parser.add_argument("--latency-s", type=float, default=30.0)
    parser.add_argument(
        "--latency-trigger", default="0 seconds", help="processingTime of the latency queries"
    )
    parser.add_argument("--no-noop", action="store_true", help="skip the noop-sink rows")
    parser.add_argument(
        "--mirror-writers", default="local,distributed",
        help="the mirror writers measured, comma list: local (toArrow + driver write), "
        "distributed (Spark's tasks write the files)",
    )  # fmt: skip
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument(
        "--writer-only", type=int, default=0, help="only MirrorWriter.write, up to N rows"
    )
    parser.add_argument(
        "--typed", type=int, default=0,
        help="only typed-column reading of N JSON documents vs spark.read.json (appended)",
    )  # fmt: skip
    parser.add_argument(
        "--standalone", type=int, default=0,
        help="only the mirror of N changes on a standalone cluster, 1 and 2 executors (appended)",
    )  # fmt: skip
    parser.add_argument(
        "--driver-memory", type=int, default=0,
        help="only the driver's peak RSS mirroring N changes at batches of 250k/1M/2.5M "
        "(standalone cluster; appended)",
    )  # fmt: skip
    parser.add_argument("--memory-child", default="", help=argparse.SUPPRESS)
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
    sizes = [int(s) for s in args.sizes.split(",") if s]  # "" runs the latency part only
    out: list[str] = []
    if args.memory_child:
        memory_child(json.loads(args.memory_child))
        return
    appended: list[tuple[int, Callable[[int, Path, list[str]], None]]] = [
        (args.typed, bench_typed),
        (args.standalone, lambda n, work, out: bench_standalone(n, args, work, out)),
        (args.driver_memory, lambda n, work, out: bench_driver_memory(n, args, work, out)),
    ]
    for n, bench in appended:
        if not n:
            continue
        work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
        try:
            bench(n, work, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if args.output:
                with open(args.output, "a") as handle:
                    handle.write("\n" + "\n".join(out) + "\n")
        return
    if args.writer_only:
        work = Path(tempfile.mkdtemp(prefix="bench-writer-"))
        try:
            say(out, f"# bench_spark {' '.join(sys.argv[1:])}")
            bench_writer(args.writer_only, args, work, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
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
