"""Node benchmark: KV ingest and DCP streaming end to end, next to Redis 7 Streams.

Rows (every figure is one run at full size, timed with ``time.perf_counter``):

* ingest ops/s: ``KvClient.upsert_many`` (pipelined SETs, 10-byte keys, 100-byte values),
  durability ``none`` on a default node (fsync per flush) and on a ``--no-durable`` node — one
  call for all items, the client keeping two windows of ``PIPELINE_DEPTH_MAX`` in flight —
  and ``persist`` on a default node, one call per window of ``PERSIST_WINDOW`` (each waits
  for the persisted seqno of every vbucket it wrote). Peer: redis-py (hiredis parser) XADD to
  one stream in pipelines of ``PIPELINE_DEPTH_MAX``, field = the key, value = the 100-byte
  value, on a redis-server without RDB or AOF; for ``persist`` pipelines of
  ``PERSIST_WINDOW`` with ``appendonly yes``/``appendfsync always`` (Redis fsyncs the AOF
  before it answers a pipeline: a group commit per pipeline, like our per-window wait);
  ``everysec`` is shown for reference.
* DCP items/s: one ``DcpClient`` over all 64 vbuckets, ``to_latest``, from the beginning, timed
  from the stream requests to the 64th ``StreamEnded``. Every item is counted and each
  vbucket's session seqno checked against its expected high seqno.
  From DISK: load, stop the node with SIGTERM, restart it, stream (all of it is backfill).
  From MEMORY: a ``--no-durable`` node with a checkpoint quota far above the load and a
  "parked" DCP connection whose cursors sit at seqno 0 of every vbucket (window 1 byte, never
  acks), so the checkpoints keep every item; load, wait until the node has persisted it (the
  stream times streaming, not the flusher catching up meanwhile), then stream. Without parked
  cursors the flushed checkpoints are freed and the stream is all backfill whatever the quota.
  The markers seen (flags & 1 memory, & 2 disk) and the items under each kind are printed, so
  the labels can be checked, with each side's CPU use during the stream (from /proc).
  Peer: XREAD COUNT 10000 from one stream until all N entries are read.

Each row also prints each side's CPU use (from /proc), the CPU the rest of the machine used
meanwhile, and CPU time per item: on a shared machine the throughput moves with other load, the
CPU per item much less.

The consumer runs on uvloop when it is installed (as ``changefeed serve`` does), else asyncio.
Every process the benchmark starts is stopped when its block exits, and on SIGTERM/SIGINT;
every wait has a deadline. A failed run keeps its work directory (node logs) and says where.

Usage::

    .venv/bin/python bench/bench_node.py                 # 1,000,000 items (8-12 min here)
    .venv/bin/python bench/bench_node.py --items 500000  # what results_node.txt reports
    .venv/bin/python bench/bench_node.py --quick         # 50,000 items, a smoke run
    .venv/bin/python bench/bench_node.py --profile       # only the profile, no table

``--profile`` ingests (durability none and persist) and streams once from disk and once from
memory with py-spy (``pip install py-spy``) sampling the node and the client (this process), and
prints the top functions by own time on each side. Needs ``redis-server`` (Debian
``redis-server``) and ``pip install redis hiredis`` for the peer rows; ``--no-redis`` skips them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.metadata
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    KvClient,
    Snapshot,
    StreamEnded,
    StreamRefused,
)
from changefeed.consumer.connection import Connection
from changefeed.consumer.dcp_client import SEQNO_FOREVER
from changefeed.consumer.handshake import handshake
from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX, Durability
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamRequest,
    encode_dcp_control,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.snapshot_marker import MarkerFlag
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_bench_procs import RedisProcess, SpySampler, node_process, stop_children, top_self_time

VBUCKETS = 64
VALUE_BYTES = 100
KEY_FORMAT = b"key%07d"  # 10 bytes up to 9,999,999 items
# XADDs per Redis pipeline without persistence: as many as our client's window (Redis's rate
# is its Python client's: 1000 or 4096 measured the same), and per window that waits for
# persistence on either side (AOF always answers a pipeline after its fsync).
REDIS_PIPELINE = PIPELINE_DEPTH_MAX
PERSIST_WINDOW = 1000
REDIS_XREAD_COUNT = 10_000
REDIS_STREAM = "bench"
MEMORY_QUOTA_BYTES = 8 << 30  # far above the load: nothing is evicted from the checkpoints
STREAM_DEADLINE_S = 900.0
INGEST_DEADLINE_S = 1800.0
PARK_DEADLINE_S = 60.0
T = TypeVar("T")


def make_items(count: int) -> list[tuple[bytes, bytes]]:
    """Unique 10-byte keys with distinct 100-byte values."""
    assert 0 < count < 10_000_000, count
    items = [(KEY_FORMAT % n, b"%0100d" % n) for n in range(count)]
    assert len(items[-1][0]) == 10, items[-1][0]
    assert len(items[-1][1]) == VALUE_BYTES, len(items[-1][1])
    return items


def per_vbucket_counts(items: list[tuple[bytes, bytes]]) -> dict[int, int]:
    """Items per vbucket: each vbucket's high seqno on a fresh node loaded with ``items``."""
    return dict(collections.Counter(vbucket_for_key(key, VBUCKETS) for key, _ in items))


# -- CPU accounting -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (all threads)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def write_syscalls(pid: int) -> int:
    """Write system calls ``pid`` made so far, all threads (/proc/<pid>/io ``syscw``)."""
    with open(f"/proc/{pid}/io") as handle:
        fields = dict(line.split(": ") for line in handle.read().splitlines())
    return int(fields["syscw"])


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, all cores (/proc/stat, incl. steal)."""
    with open("/proc/stat") as handle:
        ticks = [int(x) for x in handle.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    """Wall time of a timed block and the CPU each side used meanwhile."""

    seconds: float
    server_cpu_s: float
    client_cpu_s: float
    machine_cpu_s: float

    def describe(self, count: int) -> str:
        """CPU use of each side, and CPU time per item (``count`` items in the block).

        The per-item figures hardly depend on what else runs on the machine; 1 / the larger
        of the two is the rate if each side had a core of its own (both are one thread).
        """
        others = max(0.0, self.machine_cpu_s - self.server_cpu_s - self.client_cpu_s)

        def pct(cpu_s: float) -> str:
            return f"{100 * cpu_s / self.seconds:.0f}%"

        server_us = 1e6 * self.server_cpu_s / count
        client_us = 1e6 * self.client_cpu_s / count
        return (
            f"CPU % of one core: server {pct(self.server_cpu_s)}, client "
            f"{pct(self.client_cpu_s)}, other processes {pct(others)}; CPU per item: server "
            f"{server_us:.2f} us, client {client_us:.2f} us -> a-core-each ceiling "
            f"{self.ceiling(count):,.0f}/s"
        )

    def ceiling(self, count: int) -> float:
        """Items/s if the busier side had a core to itself (it is single-threaded)."""
        busiest_s = max(self.server_cpu_s, self.client_cpu_s)
        return count / busiest_s if busiest_s > 0 else float("inf")


class Meter:
    """Times a block with ``perf_counter``; CPU of the server pid, this process, the machine."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.usage: Usage | None = None

    def __enter__(self) -> Meter:
        self._server = cpu_seconds(self.server_pid)
        self._client = time.process_time()
        self._machine = machine_busy_seconds()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self._started
        self.usage = Usage(
            seconds,
            cpu_seconds(self.server_pid) - self._server,
            time.process_time() - self._client,
            machine_busy_seconds() - self._machine,
        )


# -- our node -------------------------------------------------------------------------------


async def ingest(
    port: int, server_pid: int, items: list[tuple[bytes, bytes]], durability: Durability
) -> Usage:
    """Upsert ``items``: without durability one ``upsert_many`` call (the client keeps two
    windows of PIPELINE_DEPTH_MAX in flight); with it one call per window, each returning
    once its window is persisted, as each XADD pipeline with AOF always answers after its
    fsync."""
    kv = await KvClient.connect("127.0.0.1", port)
    written = 0
    step = len(items) if durability == "none" else PERSIST_WINDOW
    try:
        async with asyncio.timeout(INGEST_DEADLINE_S):
            with Meter(server_pid) as meter:
                for first in range(0, len(items), step):
                    window = items[first : first + step]
                    written += len(await kv.upsert_many(window, durability=durability))
    finally:
        await kv.close()
    assert written == len(items), (written, len(items))
    assert meter.usage is not None
    return meter.usage


@dataclass
class StreamResult:
    usage: Usage
    items: int
    markers: dict[str, int] = field(default_factory=dict)  # "memory"/"disk" -> markers
    items_from: dict[str, int] = field(default_factory=dict)  # "memory"/"disk" -> items

    @property
    def seconds(self) -> float:
        return self.usage.seconds

    @property
    def source(self) -> str:
        kinds = [kind for kind in ("memory", "disk") if self.items_from.get(kind)]
        return "+".join(kinds) or "none"

    def describe(self) -> str:
        m, d = self.markers, self.items_from
        return (
            f"markers: {m['memory']} memory, {m['disk']} disk; items under them: "
            f"{d['memory']:,} memory, {d['disk']:,} disk -> source: {self.source}"
        )


async def stream_all(
    port: int, node_pid: int, high_seqnos: dict[int, int], buffer_bytes: int
) -> StreamResult:
    """Stream every vbucket from the beginning to its high seqno at request time.

    Items per source are counted from the markers' ranges (unique keys: no dedup, so a
    snapshot ending at e after seqno s holds e - s items); the loop touches no single item.
    """
    config = ClientConfig(host="127.0.0.1", port=port, to_latest=True, buffer_bytes=buffer_bytes)
    vbuckets = list(range(VBUCKETS))
    expected = sum(high_seqnos.values())
    items = ended = 0
    markers = {"memory": 0, "disk": 0}
    items_from = {"memory": 0, "disk": 0}
    snap_end: dict[int, int] = dict.fromkeys(vbuckets, 0)
    async with DcpClient(config) as client:
        async with asyncio.timeout(STREAM_DEADLINE_S):
            with Meter(node_pid) as meter:
                await client.stream(vbuckets)
                async for event in client.events():
                    if isinstance(event, Changes):
                        items += len(event.columns)
                    elif isinstance(event, Snapshot):
                        assert event.flags & (MarkerFlag.MEMORY | MarkerFlag.DISK), event
                        source = "memory" if event.flags & MarkerFlag.MEMORY else "disk"
                        markers[source] += 1
                        items_from[source] += event.snap_end - snap_end[event.vbucket]
                        snap_end[event.vbucket] = event.snap_end
                    elif isinstance(event, StreamEnded):
                        ended += 1
                        if ended == len(vbuckets):
                            break
                    elif isinstance(event, StreamRefused):
                        raise RuntimeError(f"stream refused: {event}")
        seqnos = {vb: client.session.get(vb).seqno for vb in vbuckets}
    assert items == expected, (items, expected)
    assert seqnos == {vb: high_seqnos.get(vb, 0) for vb in vbuckets}, "a vbucket is short"
    assert sum(items_from.values()) == expected, (items_from, expected)
    assert meter.usage is not None
    return StreamResult(meter.usage, items, markers, items_from)


async def park_cursors(port: int) -> Connection:
    """A DCP connection whose cursors stay at seqno 0 of every vbucket, reading nothing.

    It opens every stream from the beginning with a 1-byte flow-control window and never
    acks, so the node sends it at most one message and its cursors cannot move: the
    checkpoints must keep everything loaded after it (the quota is far above the load), and
    a later stream from the beginning can be served from memory. (``DcpClient`` acks what
    its reader task receives, whether or not the application takes it, so it cannot park.)
    """
    conn = await Connection.open("127.0.0.1", port)
    try:
        async with asyncio.timeout(PARK_DEADLINE_S):
            await handshake(
                conn, agent="bench:parked", user="Administrator", password="password",
                bucket="default",
            )  # fmt: skip
            opened = DcpOpen(conn.next_opaque(), "bench:parked", OpenFlag.PRODUCER)
            await _expect_ok(conn, encode_dcp_open(opened))
            control = DcpControl(conn.next_opaque(), "connection_buffer_size", "1")
            await _expect_ok(conn, encode_dcp_control(control))
            for vb in range(VBUCKETS):
                request = StreamRequest(vb, conn.next_opaque(), 0, 0, SEQNO_FOREVER, 0, 0, 0)
                await _expect_ok(conn, encode_stream_request(request))
    except BaseException:
        await conn.close()
        raise
    return conn


async def _expect_ok(conn: Connection, request: bytes) -> None:
    opaque = int.from_bytes(request[12:16], "big")  # header bytes 12..15 (dcp-wire.md §2)
    response = await conn.request(request, opaque)
    assert response.status == Status.SUCCESS, (response.status, response.value)


async def wait_flushed(port: int, high_seqnos: dict[int, int]) -> None:
    """Until the node has persisted every vbucket's high seqno (OBSERVE_SEQNO, which also
    hurries its flusher): a stream row then times streaming, not the flusher catching up
    with the load meanwhile."""
    async with await KvClient.connect("127.0.0.1", port) as kv:
        await asyncio.gather(
            *(
                kv.wait_persisted(MutationResult(vbucket=vb, seqno=high, cas=0, vb_uuid=0))
                for vb, high in high_seqnos.items()
            )
        )


async def load_then_stream_memory(
    port: int, node_pid: int, items: list[tuple[bytes, bytes]], buffer_bytes: int
) -> tuple[Usage, StreamResult]:
    """Park cursors, load ``items`` (timed), then stream everything from the beginning."""
    parked = await park_cursors(port)
    try:
        load = await ingest(port, node_pid, items, "none")
        await wait_flushed(port, per_vbucket_counts(items))
        result = await stream_all(port, node_pid, per_vbucket_counts(items), buffer_bytes)
    finally:
        await parked.close()
    return load, result


# -- Redis ----------------------------------------------------------------------------------


def redis_ingest(
    port: int, server_pid: int, items: list[tuple[bytes, bytes]], pipeline: int
) -> Usage:
    """XADD ``items`` (field = key, value = value) in pipelines of ``pipeline``."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60.0)
    try:
        client.delete(REDIS_STREAM)
        with Meter(server_pid) as meter:
            for first in range(0, len(items), pipeline):
                pipe = client.pipeline(transaction=False)
                for key, value in items[first : first + pipeline]:
                    pipe.xadd(REDIS_STREAM, {key: value})
                pipe.execute()
        length = client.xlen(REDIS_STREAM)
    finally:
        client.close()
    assert length == len(items), (length, len(items))
    assert meter.usage is not None
    return meter.usage


def redis_stream(port: int, server_pid: int, expected_items: int) -> Usage:
    """XREAD COUNT REDIS_XREAD_COUNT from the start until ``expected_items`` entries."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60.0)
    items = 0
    try:
        last_id: bytes | str = "0-0"
        deadline = time.monotonic() + STREAM_DEADLINE_S
        with Meter(server_pid) as meter:
            while items < expected_items:
                assert time.monotonic() < deadline, "XREAD deadline"
                reply: Any = client.xread({REDIS_STREAM: last_id}, count=REDIS_XREAD_COUNT)
                assert reply, f"stream ended after {items} entries"
                entries = reply[0][1]
                items += len(entries)
                last_id = entries[-1][0]
    finally:
        client.close()
    assert items == expected_items, (items, expected_items)
    assert meter.usage is not None
    return meter.usage


def hiredis_in_use() -> bool:
    import redis.utils

    return bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))


# -- the runs -------------------------------------------------------------------------------


def run_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when installed (as ``changefeed serve`` does), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def loop_name() -> str:
    try:
        return f"uvloop {importlib.metadata.version('uvloop')}"
    except importlib.metadata.PackageNotFoundError:
        return "asyncio"


def log(message: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rate(n: int, usage: Usage) -> str:
    return f"{n / usage.seconds:,.0f}/s in {usage.seconds:.1f} s; {usage.describe(n)}"


def bench_ours(
    args: argparse.Namespace, items: list[tuple[bytes, bytes]], work: Path
) -> dict[str, Any]:
    n = len(items)
    high_seqnos = per_vbucket_counts(items)
    out: dict[str, Any] = {}
    # (a) ingest, durability none, default (durable) node; then (b) stream it from disk.
    with node_process(work / "disk", vbuckets=VBUCKETS) as node:
        log(f"ingest none, default node: {n:,} items")
        out["ingest_none"] = run_loop(ingest(node.port, node.pid, items, "none"))
        log(f"  {rate(n, out['ingest_none'])}")
        stopping = time.perf_counter()
        node.stop()
        out["stop_s"] = time.perf_counter() - stopping
        log(f"  clean stop (SIGTERM) in {out['stop_s']:.1f} s; restart; stream from disk")
        node.start()
        out["disk"] = run_loop(stream_all(node.port, node.pid, high_seqnos, args.buffer_bytes))
        log(f"  {rate(n, out['disk'].usage)}; {out['disk'].describe()}")
    shutil.rmtree(work / "disk", ignore_errors=True)
    # (b) memory: parked cursors + a quota far above the load keep every item in the
    # checkpoints. Its load is also the durability-none figure of a --no-durable node.
    flags = ["--checkpoint-quota-bytes", str(MEMORY_QUOTA_BYTES), "--no-durable"]
    with node_process(work / "memory", vbuckets=VBUCKETS, extra=flags) as node:
        log(f"park cursors, load {n:,} items (--no-durable node), stream from memory")
        load, result = run_loop(
            load_then_stream_memory(node.port, node.pid, items, args.buffer_bytes)
        )
        out["ingest_no_durable"], out["memory"] = load, result
        log(f"  load {rate(n, load)}")
        log(f"  stream {rate(n, result.usage)}; {result.describe()}")
    shutil.rmtree(work / "memory", ignore_errors=True)
    # (a) ingest, durability persist, on a fresh default node.
    persist_items = items[: args.persist_items] if args.persist_items else items
    out["persist_n"] = len(persist_items)
    with node_process(work / "persist", vbuckets=VBUCKETS) as node:
        log(f"ingest persist, default node: {len(persist_items):,} items")
        out["ingest_persist"] = run_loop(ingest(node.port, node.pid, persist_items, "persist"))
        log(f"  {rate(len(persist_items), out['ingest_persist'])}")
    shutil.rmtree(work / "persist", ignore_errors=True)
    return out


def persist_only(args: argparse.Namespace, items: list[tuple[bytes, bytes]], work: Path) -> None:
    """The persist row alone: the node, then Redis with AOF always, same windows."""
    persist_items = items[: args.persist_items] if args.persist_items else items
    n = len(persist_items)
    print("\n".join(header(args, n)))
    print(f"load average at start: {os.getloadavg()}")
    with node_process(work / "persist", vbuckets=VBUCKETS) as node:
        writes = write_syscalls(node.pid)
        ours = run_loop(ingest(node.port, node.pid, persist_items, "persist"))
        writes = write_syscalls(node.pid) - writes
    print(f"persist, node:  {rate(n, ours)}; write syscalls {writes:,} ({writes / n:.4f} a write)")
    if not args.no_redis:
        aof = ["--appendonly", "yes", "--appendfsync", "always"]
        with RedisProcess(work / "redis-aof-always", extra=aof) as server:
            theirs = redis_ingest(server.port, server.pid, persist_items, PERSIST_WINDOW)
        print(f"persist, redis: {rate(n, theirs)}")
        print(f"ratio {theirs.seconds / ours.seconds:.2f}x")
    print(f"load average at end: {os.getloadavg()}")


def bench_redis(items: list[tuple[bytes, bytes]], persist_n: int, work: Path) -> dict[str, Any]:
    import redis

    n = len(items)
    out: dict[str, Any] = {"client": redis.__version__}
    with RedisProcess(work / "redis-mem") as server:
        out["version"] = server.version
        log(f"redis XADD, no persistence: {n:,} entries")
        out["ingest_none"] = redis_ingest(server.port, server.pid, items, REDIS_PIPELINE)
        log(f"  {rate(n, out['ingest_none'])}")
        log(f"redis XREAD COUNT {REDIS_XREAD_COUNT}: {n:,} entries")
        out["stream"] = redis_stream(server.port, server.pid, n)
        log(f"  {rate(n, out['stream'])}")
    for fsync, count in (("always", persist_n), ("everysec", n)):
        aof = ["--appendonly", "yes", "--appendfsync", fsync]
        with RedisProcess(work / f"redis-aof-{fsync}", extra=aof) as server:
            log(f"redis XADD, AOF appendfsync {fsync}: {count:,} entries")
            window = PERSIST_WINDOW if fsync == "always" else REDIS_PIPELINE
            out[f"ingest_{fsync}"] = redis_ingest(server.port, server.pid, items[:count], window)
            log(f"  {rate(count, out[f'ingest_{fsync}'])}")
    return out


def profile_ingest(args: argparse.Namespace, items: list[tuple[bytes, bytes]], work: Path) -> str:
    """Ingest with durability none and persist on a default node, py-spy on both sides."""
    lines: list[str] = []
    for durability in ("none", "persist"):
        n = len(items) if durability == "none" else args.persist_items or len(items)
        spy_dir = work / f"spy-ingest-{durability}"
        with node_process(work / f"profile-ingest-{durability}", vbuckets=VBUCKETS) as node:
            log(f"profile ingest {durability}: {n:,} items, py-spy on node pid {node.pid} and us")
            with (
                SpySampler(node.pid, spy_dir / "node.txt"),
                SpySampler(os.getpid(), spy_dir / "client.txt"),
            ):
                usage = run_loop(ingest(node.port, node.pid, items[:n], durability))
        shutil.rmtree(work / f"profile-ingest-{durability}", ignore_errors=True)
        lines.append(
            f"### ingest, durability {durability}, default node, under py-spy "
            f"({SpySampler.RATE_HZ} Hz, non-blocking): {rate(n, usage)}"
        )
        for side in ("node", "client"):
            lines.append(f"{side}: top functions by own time, % of busy samples while ingesting")
            lines.extend(top_self_time(spy_dir / f"{side}.txt", args.profile_top))
    return "\n".join(lines)


def profile_streams(args: argparse.Namespace, items: list[tuple[bytes, bytes]], work: Path) -> str:
    """Stream once from disk and once from memory with py-spy on both sides."""
    n = len(items)
    high_seqnos = per_vbucket_counts(items)
    lines: list[str] = []
    memory_flags = ["--checkpoint-quota-bytes", str(MEMORY_QUOTA_BYTES), "--no-durable"]
    for label, flags in (("disk", ["--no-durable"]), ("memory", memory_flags)):
        spy_dir = work / f"spy-{label}"
        with node_process(work / f"profile-{label}", vbuckets=VBUCKETS, extra=flags) as node:
            log(f"profile {label}: load {n:,} items (--no-durable node)")
            if label == "disk":
                run_loop(ingest(node.port, node.pid, items, "none"))
                node.stop()
                node.start()
            result = run_loop(_profiled_stream(args, node, items, high_seqnos, label, spy_dir))
        shutil.rmtree(work / f"profile-{label}", ignore_errors=True)
        lines.append(
            f"### streaming from {label.upper()} under py-spy ({SpySampler.RATE_HZ} Hz, "
            f"non-blocking): {rate(n, result.usage)}; {result.describe()}"
        )
        for side in ("node", "consumer"):
            lines.append(f"{side}: top functions by own time, % of busy samples while streaming")
            lines.extend(top_self_time(spy_dir / f"{side}.txt", args.profile_top))
    return "\n".join(lines)


async def _profiled_stream(
    args: argparse.Namespace,
    node: NodeProcess,
    items: list[tuple[bytes, bytes]],
    high_seqnos: dict[int, int],
    label: str,
    spy_dir: Path,
) -> StreamResult:
    parked = await park_cursors(node.port) if label == "memory" else None
    try:
        if parked is not None:
            await ingest(node.port, node.pid, items, "none")
            await wait_flushed(node.port, high_seqnos)
        log(f"profile {label}: stream, py-spy on node pid {node.pid} and on us")
        with (
            SpySampler(node.pid, spy_dir / "node.txt"),
            SpySampler(os.getpid(), spy_dir / "consumer.txt"),
        ):
            return await stream_all(node.port, node.pid, high_seqnos, args.buffer_bytes)
    finally:
        if parked is not None:
            await parked.close()


# -- output ---------------------------------------------------------------------------------


@dataclass
class Row:
    shape: str
    ours: float | None  # per second
    peer: float | None
    notes: list[str] = field(default_factory=list)


def machine() -> list[str]:
    model = "unknown"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as handle:
        mem_kib = int(handle.readline().split()[1])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"machine: nproc {len(os.sched_getaffinity(0))} ({os.cpu_count()} CPUs), {model}, "
        f"RAM {mem_kib / (1 << 20):.1f} GiB, {platform.platform()}; load average {load}",
        f"python: {platform.python_implementation()} {platform.python_version()}; "
        f"consumer loop: {loop_name()}",
    ]


def source_tree() -> str:
    """The commit measured and the files that differ from it (read-only git calls)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"({error})"
        return done.stdout.rstrip("\n")

    changed = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()]
    return f"source: commit {git('rev-parse', '--short', 'HEAD')}; uncommitted in src/: " + (
        ", ".join(changed) or "none"
    )


def header(args: argparse.Namespace, n: int) -> list[str]:
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    return [
        f"command: {command}  (cwd {Path.cwd()})",
        *machine(),
        source_tree(),
        f"items: {n:,}, 10-byte keys, {VALUE_BYTES}-byte values, {VBUCKETS} vbuckets; KV window "
        f"{PIPELINE_DEPTH_MAX} ({PERSIST_WINDOW} per persist call); "
        f"DCP client buffer_bytes {args.buffer_bytes:,}",
    ]


def table(rows: list[Row]) -> list[str]:
    lines = [f"{'shape (ours | redis)':<50} {'changefeed':>11} {'redis':>11} {'ours/redis':>10}"]
    lines.append("-" * len(lines[0]))
    for row in rows:
        ours = f"{row.ours:,.0f}" if row.ours else "-"
        peer = f"{row.peer:,.0f}" if row.peer else "-"
        ratio = f"{row.ours / row.peer:.2f}x" if row.ours and row.peer else "-"
        lines.append(f"{row.shape:<50} {ours:>11} {peer:>11} {ratio:>10}")
        lines.extend(f"    {note}" for note in row.notes)
    return lines


def report(
    args: argparse.Namespace, n: int, ours: dict[str, Any], redis: dict[str, Any], total_s: float
) -> None:
    persist_n = ours["persist_n"]

    def row(shape: str, count: int, ours_key: str | None, peer_key: str | None) -> Row:
        mine = ours[ours_key] if ours_key else None
        theirs: Usage | None = redis.get(peer_key) if peer_key else None
        notes = []
        if isinstance(mine, StreamResult):
            notes.append(f"ours:  {mine.describe()}")
            mine = mine.usage
        if mine is not None:
            notes.append(f"ours:  {mine.describe(count)}")
        if theirs is not None:
            notes.append(f"redis: {theirs.describe(count)}")
        return Row(
            shape,
            count / mine.seconds if mine else None,
            count / theirs.seconds if theirs else None,
            notes,
        )

    rows = [
        row("ingest ops/s, none, default node | XADD", n, "ingest_none", "ingest_none"),
        row("ingest ops/s, none, --no-durable node | XADD", n, "ingest_no_durable", "ingest_none"),
        row(
            f"ingest ops/s, persist ({persist_n:,}) | AOF always",
            persist_n,
            "ingest_persist",
            "ingest_always",
        ),
        row("  (reference) XADD, AOF everysec", n, None, "ingest_everysec"),
        row("DCP items/s from DISK | XREAD", n, "disk", "stream"),
        row("DCP items/s from MEMORY | XREAD", n, "memory", "stream"),
    ]
    lines = header(args, n)
    if redis:
        lines.append(
            f"peer: redis-server {redis['version']} (Debian), redis-py {redis['client']} "
            f"(hiredis parser: {hiredis_in_use()}), one stream, XADD pipeline {REDIS_PIPELINE} "
            f"({PERSIST_WINDOW} with AOF always), "
            f"XREAD COUNT {REDIS_XREAD_COUNT}, no RDB; AOF only where the row says"
        )
    lines += ["", *table(rows), ""]
    if redis:
        xread: Usage = redis["stream"]
        for label in ("disk", "memory"):
            mine: Usage = ours[label].usage
            ratio = xread.seconds / mine.seconds
            ceiling_ratio = mine.ceiling(n) / xread.ceiling(n)
            lines.append(
                f"goal (DCP >= 2x XREAD), from {label}: measured {ratio:.2f}x "
                f"({ratio / 2:.0%} of the goal); a-core-each ceilings {ceiling_ratio:.2f}x "
                f"({ceiling_ratio / 2:.0%} of the goal)"
            )
    lines.append(
        f"total wall time {total_s:.0f} s; one run per figure on a shared machine ('other "
        f"processes' = CPU the rest of the machine used meanwhile)"
    )
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="50,000 items")
    parser.add_argument(
        "--persist-items", type=int, default=0, help="items for the persist rows (default: all)"
    )
    parser.add_argument("--buffer-bytes", type=int, default=ClientConfig().buffer_bytes)
    parser.add_argument(
        "--profile", action="store_true", help="only profile each node row (no table)"
    )
    parser.add_argument("--profile-top", type=int, default=10, help="functions per profile")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument(
        "--persist-only",
        action="store_true",
        help="only the persist row (node and Redis AOF always), a line each",
    )
    args = parser.parse_args()
    if args.quick:
        args.items = 50_000
    args.persist_items = min(args.persist_items, args.items)
    return args


def main() -> None:
    args = parse_args()
    items = make_items(args.items)
    n = len(items)
    work = Path(tempfile.mkdtemp(prefix="bench_node_"))

    def abandon(signum: int, frame: object) -> None:
        # Not an exception: one raised inside the event loop can leave asyncio waiting on
        # tasks at shutdown with the children still running. Stop them here and leave.
        log(f"signal {signum}: stopping child processes and exiting")
        stop_children()
        shutil.rmtree(work, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, abandon)
    signal.signal(signal.SIGINT, abandon)
    started = time.perf_counter()
    try:
        if args.persist_only:
            persist_only(args, items, work)
            shutil.rmtree(work, ignore_errors=True)
            return
        if args.profile:
            profile = profile_ingest(args, items, work) + "\n" + profile_streams(args, items, work)
        else:
            ours = bench_ours(args, items, work)
            redis = {} if args.no_redis else bench_redis(items, ours["persist_n"], work)
    except BaseException:
        log(f"failed: kept {work} (node logs: */node.log, data directories) for inspection")
        raise
    shutil.rmtree(work, ignore_errors=True)
    if args.profile:
        print("\n".join([*header(args, n), "", profile]))
        return
    report(args, n, ours, redis, time.perf_counter() - started)


if __name__ == "__main__":
    main()
