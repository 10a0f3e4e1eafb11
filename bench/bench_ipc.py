"""Shared-memory fan-out (changefeed.ipc) against TCP DCP streams and iceoryx2; the atomics
choice; recovery times after kill -9.

Sections (one run, well under 2 minutes):

1. Atomics. ns per operation from Python on a shared-memory mapping for each candidate
   (``atomicshm``, ctypes on the system ``libatomic``, the ``atomics`` package), and the cost
   of what a reader does per batch (reference + release: 2 transaction-logged CAS/fetch ops and
   4 flag stores, 2 loads). The chosen backend is the fastest that loads.
2. Transport only (no node; not the product): items/s delivered to 1 and 4 local readers (separate
   processes) and CPU us per item (all processes, publisher included, over items
   delivered). Items: change rows with 100-byte values, 4096 rows per Arrow batch (one ring
   slot), the batch built once and published ``--batches`` times. Every reader takes each
   batch, reads it (zero copy) and sums its seqno column, then releases it. The publisher
   keeps at most half the ring ahead of the slowest reader, so nothing is lost and every
   reader gets every batch.
   * shm: changefeed.ipc (Provider.publish / Subscription.receive).
   * iceoryx2: the same serialized batch bytes, publish -> subscribe through iceoryx2's Python
     binding (Slice[c_uint8], safe overflow off, RetryUntilDelivered: lossless); readers poll.
   * TCP DCP: the same readers, each a DcpClient streaming every vbucket of a node holding
     ``--dcp-items`` 100-byte items in memory (the node's checkpoints), summing each run's seqnos.
2b. End to end (``--section live``, the product): a node publishing live changes from a
   writer (in the bench process, not counted), 1 and 4 reader processes from now until each
   has every change: ``LocalStream`` per service (shm) against one ``DcpClient`` each whose
   frames become change rows (tcp) or are only decoded (tcp-cols); then ``changefeed stream
   --follow --output`` readers (JSON lines; ``--local`` for shm; ``--cli-keys``). Items/s
   delivered, total CPU us per delivered item (node + readers from ready; the node's includes
   the ingest), the node's CPU per key.
3. Node CPU per ingested key with ``--shm 2`` and no reader attached, against ``--shm`` off
   (issue 27: free when unused): a node (``--no-durable``) takes ``--idle-keys`` upserts of
   100-byte values from one client; the node's CPU (utime + stime from /proc) over the load,
   per key; the best of ``--idle-repeat`` alternating runs (the machine is shared). With no
   reader the shm groups pause a second after the node starts, so the difference is what a
   change costs them then. ``--section idle`` runs only this.
4. Recovery. After a reader holding 2 batches is killed: how long its restart's subscribe takes
   (rollback of the dead log included) until every slot and the budget are back. After the
   provider is killed mid-stream: restart -> offer (segments reused, IN_WRITING cleaned) ->
   the readers' next batch.

Usage::

    .venv/bin/python bench/bench_ipc.py            # writes bench/results_ipc.txt
    .venv/bin/python bench/bench_ipc.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import mmap
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.ipc import Geometry, subscribe
from changefeed.ipc.atomic import atomics_for, backends
from changefeed.ipc.layout import NODE_NEXT_SEQ
from changefeed.ipc.provider import Provider
from changefeed.ipc.segments import Segment, ServicePaths

ROWS = 4096
VALUE_BYTES = 100
GROUP = (0, 1, 2, 3)
SLOTS = 16
GEOMETRY = Geometry(SLOTS, 2 * 1024 * 1024, 6, GROUP)
RESULTS = Path(__file__).with_name("results_ipc.txt")
HERE = Path(__file__).resolve()


# -- helpers ------------------------------------------------------------------------------------


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def change_batch(rows: int = ROWS, first: int = 1) -> pa.RecordBatch:
    seqnos = np.arange(first, first + rows, dtype=np.int64)
    return pa.RecordBatch.from_arrays(
        [
            pa.array((seqnos % len(GROUP)).astype(np.int32)),
            pa.array(seqnos),
            pa.array([f"key{s:08d}" for s in seqnos.tolist()], pa.string()),
            pa.array([b"v" * VALUE_BYTES] * rows, pa.binary()),
            pa.array(["mutation"] * rows, pa.string()),
            pa.array(seqnos),
            pa.array(np.zeros(rows, np.int32)),
            pa.array(np.zeros(rows, np.int32)),
            pa.array(np.ones(rows, np.int64)),
            pa.array(seqnos),
            pa.array(seqnos),
        ],
        schema=CHANGE_ROW_SCHEMA,
    )


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE), *args], stdout=subprocess.PIPE, text=True)


def read_json(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child {proc.args} ended early (rc {proc.poll()})")
        with contextlib.suppress(ValueError):
            return dict(json.loads(line))
    raise TimeoutError(proc.args)


# -- 1. atomics ---------------------------------------------------------------------------------


def timed(fn: Callable[[], object], n: int) -> float:
    """ns per call of `fn` over `n` calls."""
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e9


def atomics_row(buf: memoryview, name: str, n: int) -> list[float]:
    """load u64, store u8, CAS u64, fetch_add u64: ns each, with the backend `name`."""
    if name != "atomics":
        a = atomics_for(buf, name)
        try:
            return [
                timed(lambda: a.load_u64(0), n),
                timed(lambda: a.store_u8(24, 1), n),
                timed(lambda: a.cas_u64(8, 0, 0), n),
                timed(lambda: a.fetch_add_u64(16, 1), n),
            ]
        finally:
            a.close()
    import atomics  # the PyPI package: one view object per field, opened once

    fields = {"u64": (0, 8), "cas": (8, 8), "add": (16, 8), "u8": (24, 1)}
    contexts = {
        k: atomics.atomicview(buffer=buf[o : o + w], atype=atomics.UINT)
        for k, (o, w) in fields.items()
    }
    views = {k: ctx.__enter__() for k, ctx in contexts.items()}
    try:
        rounds = max(2000, n // 50)  # ~5-10 us an operation: fewer rounds
        return [
            timed(views["u64"].load, rounds),
            timed(lambda: views["u8"].store(1), rounds),
            timed(lambda: views["cas"].cmpxchg_strong(0, 0), rounds),
            timed(lambda: views["add"].fetch_add(1), rounds),
        ]
    finally:
        for ctx in contexts.values():
            ctx.__exit__(None, None, None)


def bench_atomics(n: int) -> tuple[list[str], str]:
    """ns per op for each backend, on one anonymous shared mapping."""
    memory = mmap.mmap(-1, 4096)
    buf = memoryview(memory)
    lines = [
        f"{'backend':<12} {'load u64':>9} {'store u8':>9} {'CAS u64':>9} {'fetch_add':>10} "
        f"{'per batch (ref+release)':>24}"
    ]
    names = [*backends()]
    with contextlib.suppress(ImportError):
        import atomics  # noqa: F401

        names.append("atomics")
    for name in names:
        load, store, cas, add = atomics_row(buf, name, n)
        # A reader's batch: reference (begin store, load, CAS, commit store) and release (begin
        # store, fetch_sub, commit store), plus the head load and the index load.
        per_batch = (4 * store + 4 * load + cas + add) / 1000
        lines.append(
            f"{name:<12} {load:>9.0f} {store:>9.0f} {cas:>9.0f} {add:>10.0f} {per_batch:>21.2f} us"
        )
    buf.release()
    memory.close()
    return lines, backends()[0]


# -- 2. fan-out ---------------------------------------------------------------------------------


def role_shm_reader(args: argparse.Namespace) -> None:
    sub = subscribe(args.service, directory=args.dir, app_id=args.app, max_samples=1, start=1)
    emit(ready=True)
    cpu0 = time.process_time()
    got = rows = total = 0
    t0 = 0.0
    while got < args.batches:
        sample = sub.receive(10.0)
        if sample is None:
            break
        if not got:
            t0 = time.perf_counter()
            cpu0 = time.process_time()
        with sample:
            batch = sample.batch
            total += pc.sum(batch.column("seqno")).as_py()
            rows += batch.num_rows
        got += 1
    emit(
        rows=rows,
        seconds=time.perf_counter() - t0,
        cpu=time.process_time() - cpu0,
        batches=got,
        lost=sub.stats["lost"],
        waits=sub.stats["waits"],
    )
    sub.close()


def run_shm(readers: int, batches: int, directory: str) -> dict[str, float]:
    service = f"bench{uuid.uuid4().hex[:10]}"
    provider = Provider.offer(service, GEOMETRY, directory=directory)
    try:
        procs = [
            spawn(
                "--role",
                "shm-reader",
                "--service",
                service,
                "--dir",
                directory,
                "--app",
                str(i + 1),
                "--batches",
                str(batches),
            )
            for i in range(readers)
        ]
        for proc in procs:
            read_json(proc)
        message = change_batch().serialize()
        positions = np.zeros((len(GROUP), 5), np.uint64)
        cpu0 = time.process_time()
        start = time.perf_counter()
        # Where each reader's next seq is (its transaction log's NODE_NEXT_SEQ word).
        a = provider._a
        cursors = [provider.layout.node(r["log"]) + NODE_NEXT_SEQ for r in provider.readers()]
        slowest = 1
        for seq in range(1, batches + 1):
            while seq - slowest >= SLOTS // 2:  # at most half the ring ahead: nothing is lost
                slowest = min(a.load_u64(at) for at in cursors)
                if seq - slowest >= SLOTS // 2:
                    time.sleep(0)  # as iceoryx2's RetryUntilDelivered, it retries at once
            positions[:, 1] = seq * ROWS
            provider.publish(message, positions, rows=ROWS)
        publisher_cpu = time.process_time() - cpu0
        reports = [read_json(proc) for proc in procs]
        wall = time.perf_counter() - start
        for proc in procs:
            proc.wait(30)
    finally:
        provider.stop_offer()
    rows = sum(r["rows"] for r in reports)
    assert rows == readers * batches * ROWS, reports
    assert all(r["lost"] == 0 for r in reports), reports
    cpu = publisher_cpu + sum(r["cpu"] for r in reports)
    return {
        "items_s": rows / wall,
        "cpu_us": cpu / rows * 1e6,
        "seconds": wall,
        "publisher_cpu_us": publisher_cpu / rows * 1e6,
    }


def role_iox_reader(args: argparse.Namespace) -> None:
    import iceoryx2 as iox2

    iox2.set_log_level(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    service = (
        node.service_builder(iox2.ServiceName.new(args.service))
        .publish_subscribe(iox2.Slice[ctypes.c_uint8])
        .max_subscribers(8)
        .subscriber_max_buffer_size(SLOTS // 2)
        .enable_safe_overflow(False)
        .open_or_create()
    )
    subscriber = service.subscriber_builder().buffer_size(SLOTS // 2).create()
    emit(ready=True)
    got = rows = total = 0
    t0 = cpu0 = 0.0
    idle_since = time.monotonic()
    while got < args.batches and time.monotonic() - idle_since < 10:
        sample = subscriber.receive()
        if sample is None:
            time.sleep(0.00005)
            continue
        idle_since = time.monotonic()
        if not got:
            t0 = time.perf_counter()
            cpu0 = time.process_time()
        view = sample.payload().as_memory_view()
        batch = pa.ipc.read_record_batch(pa.py_buffer(view), CHANGE_ROW_SCHEMA)
        total += pc.sum(batch.column("seqno")).as_py()
        rows += batch.num_rows
        del batch, view
        sample.delete()
        got += 1
    emit(rows=rows, seconds=time.perf_counter() - t0, cpu=time.process_time() - cpu0, batches=got)


def run_iceoryx2(readers: int, batches: int) -> dict[str, float] | None:
    try:
        import iceoryx2 as iox2
    except ImportError:
        return None
    iox2.set_log_level(iox2.LogLevel.Error)
    name = f"changefeed/bench/{uuid.uuid4().hex[:10]}"
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    service = (
        node.service_builder(iox2.ServiceName.new(name))
        .publish_subscribe(iox2.Slice[ctypes.c_uint8])
        .max_subscribers(8)
        .subscriber_max_buffer_size(SLOTS // 2)
        .enable_safe_overflow(False)
        .open_or_create()
    )
    message = change_batch().serialize()
    publisher = (
        service.publisher_builder()
        .initial_max_slice_len(message.size)
        .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered)
        .create()
    )
    procs = [
        spawn("--role", "iox-reader", "--service", name, "--batches", str(batches))
        for _ in range(readers)
    ]
    for proc in procs:
        read_json(proc)
    time.sleep(0.2)  # the subscribers connect
    cpu0 = time.process_time()
    start = time.perf_counter()
    for _ in range(batches):
        sample = publisher.loan_slice_uninit(message.size)
        ctypes.memmove(sample.payload().as_ptr(), message.address, message.size)
        sample.assume_init().send()
    publisher_cpu = time.process_time() - cpu0
    reports = [read_json(proc) for proc in procs]
    wall = time.perf_counter() - start
    for proc in procs:
        proc.wait(30)
    rows = sum(r["rows"] for r in reports)
    assert rows == readers * batches * ROWS, reports
    cpu = publisher_cpu + sum(r["cpu"] for r in reports)
    return {"items_s": rows / wall, "cpu_us": cpu / rows * 1e6, "seconds": wall}


def role_dcp_reader(args: argparse.Namespace) -> None:
    from changefeed.consumer import Changes, ClientConfig, DcpClient, StreamEnded

    async def main() -> tuple[int, float, float]:
        async with DcpClient(ClientConfig(port=args.port, to_latest=True)) as client:
            emit(ready=True)
            sys.stdin.readline()  # go
            cpu0, t0 = time.process_time(), time.perf_counter()
            await client.stream(list(range(args.vbuckets)))
            rows = ended = total = 0
            async for event in client.events():
                if isinstance(event, Changes):
                    total += int(event.columns.array("seqno").sum())
                    rows += len(event.columns)
                elif isinstance(event, StreamEnded):
                    ended += 1
                    if ended == args.vbuckets:
                        break
            return rows, time.perf_counter() - t0, time.process_time() - cpu0

    try:
        import uvloop

        rows, seconds, cpu = uvloop.run(main())
    except ImportError:
        rows, seconds, cpu = asyncio.run(main())
    emit(rows=rows, seconds=seconds, cpu=cpu)


def spawn_stdin(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def run_dcp_readers(
    port: int, vbuckets: int, readers: int, node_pid: int, items: int
) -> dict[str, float]:
    procs = [
        spawn_stdin("--role", "dcp-reader", "--port", str(port), "--vbuckets", str(vbuckets))
        for _ in range(readers)
    ]
    for proc in procs:
        read_json(proc)
    server0 = cpu_seconds(node_pid)
    start = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = [read_json(proc) for proc in procs]
    wall = time.perf_counter() - start
    server_cpu = cpu_seconds(node_pid) - server0
    for proc in procs:
        proc.wait(30)
    rows = sum(r["rows"] for r in reports)
    assert rows == readers * items, (rows, readers, items)
    cpu = server_cpu + sum(r["cpu"] for r in reports)
    return {
        "items_s": rows / wall,
        "cpu_us": cpu / rows * 1e6,
        "seconds": wall,
        "server_cpu_us": server_cpu / rows * 1e6,
    }


def run_dcp_all(items: int, reader_counts: list[int], workdir: Path) -> dict[int, dict[str, float]]:
    from changefeed.cli.node_process import NodeProcess
    from changefeed.consumer import KvClient

    vbuckets = 16
    node = NodeProcess(
        workdir / "node", vbuckets=vbuckets, args=["--no-durable", "--log-level", "WARNING"]
    )
    node.start()
    try:

        async def load() -> None:
            async with await KvClient.connect("127.0.0.1", node.port) as kv:
                value = b"v" * VALUE_BYTES
                for start in range(0, items, 1000):
                    await asyncio.gather(
                        *(
                            kv.upsert(b"key%07d" % i, value)
                            for i in range(start, min(items, start + 1000))
                        )
                    )

        asyncio.run(load())
        return {r: run_dcp_readers(node.port, vbuckets, r, node.pid, items) for r in reader_counts}
    finally:
        node.stop(check=False)


def best(runs: list[dict[str, float]]) -> dict[str, float] | None:
    """The run with the most items/s (the machine is shared: the least disturbed run), with the
    slowest noted."""
    if not runs:
        return None
    top = dict(max(runs, key=lambda r: r["items_s"]))
    top["worst_items_s"] = min(r["items_s"] for r in runs)
    return top


def run_node_publisher(rows: int, workdir: Path) -> dict[str, float]:
    """The node's side: a GroupPublisher over a bucket holding `rows` items in memory (16
    vbuckets, one group), pumping and publishing until every row is in the ring. Per row: the
    in-process producer's streams read the checkpoints, the row encoder (server/shm_rows.py)
    builds change rows straight from the items, Arrow IPC into a slot."""
    from changefeed.consumer.change_rows import ChangeRows
    from changefeed.producer.backfill_slots import BackfillSlots
    from changefeed.server.bucket import Bucket
    from changefeed.server.config import NodeConfig
    from changefeed.server.shm_publisher import GroupPublisher

    async def main() -> dict[str, float]:
        config = NodeConfig(data_dir=workdir / "pubdata", vbuckets=16, durable=False)
        config.data_dir.mkdir(parents=True, exist_ok=True)
        bucket = Bucket.open(config)
        value = b"v" * VALUE_BYTES
        for n in range(rows):
            bucket.vbuckets[n % 16].set(b"key%07d" % n, value)
        geometry = Geometry(SLOTS, 2 * 1024 * 1024, 4, tuple(range(16)))
        provider = Provider.offer(
            f"bench{uuid.uuid4().hex[:10]}", geometry, directory=workdir / "pubipc"
        )
        publisher = GroupPublisher(
            bucket, provider, persisted_only=False, backfill_slots=BackfillSlots()
        )
        publisher._positions[:, 1:] = 0  # from seqno 0: every row
        provider.publish(ChangeRows().to_batch(), publisher._positions)
        cpu0, start = time.process_time(), time.perf_counter()
        publisher._request_streams()
        while publisher.stats["rows"] < rows:
            publisher._pump()
            publisher._publish_ready()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        publisher.producer.close()
        provider.stop_offer()
        return {
            "rows_s": rows / wall,
            "cpu_us": cpu / rows * 1e6,
            "batches": publisher.stats["batches"],
        }

    return asyncio.run(main())


# -- 2b. end to end: the node publishing live changes ------------------------------------------


def role_live_reader(args: argparse.Namespace) -> None:
    """Read `--count` changes written after it is ready, as change rows (Arrow, the schema of
    consumer/change_rows.py): ``--transport shm`` (a LocalStream per service of the node, from
    now: the ring's rows) or ``tcp`` (one DcpClient, every vbucket, from now: frames decoded
    and converted to rows, as the Spark source and LocalStream's fallback do); ``tcp-cols``:
    the decoded columns only, no rows (what this bench's TCP readers did before)."""
    from changefeed.consumer import Changes, ClientConfig, DcpClient, Snapshot
    from changefeed.consumer.change_rows import ChangeRows

    config = ClientConfig(port=args.port)
    began: list[float] = []  # CPU when ready: imports and setup are not per item

    async def shm() -> int:
        from changefeed.ipc.local_stream import LocalStream, services_of

        streams = [
            LocalStream(s, directory=args.dir, app_id=args.app, dcp=config, start="now")
            for s in services_of("default", args.port, args.dir)
        ]
        began.append(time.process_time())
        emit(ready=True)
        rows = total = 0
        try:
            while rows < args.count:  # bounded by the writer's count
                for local in streams:
                    batch = await local.next_batch(0.05)
                    if batch is not None:
                        rows += batch.num_rows
                        total += int(pc.sum(batch.column("seqno")).as_py() or 0)
        finally:
            for local in streams:
                local.close()
        return rows

    async def tcp() -> int:
        snapshots: dict[int, tuple[int, int]] = {}
        async with DcpClient(config) as client:
            await client.stream(list(range(args.vbuckets)), start="now")
            began.append(time.process_time())
            emit(ready=True)
            rows = total = 0
            async for event in client.events():
                if isinstance(event, Snapshot):
                    snapshots[event.vbucket] = (event.snap_start, event.snap_end)
                elif isinstance(event, Changes) and args.transport == "tcp-cols":
                    total += int(event.columns.array("seqno").sum())
                    rows += len(event.columns)
                    if rows >= args.count:
                        break
                elif isinstance(event, Changes):
                    built = ChangeRows()
                    built.append_changes(event.columns, snapshots)
                    batch = built.to_batch()
                    total += int(pc.sum(batch.column("seqno")).as_py() or 0)
                    rows += batch.num_rows
                    if rows >= args.count:
                        break
            return rows

    rows = asyncio.run(shm() if args.transport == "shm" else tcp())
    emit(rows=rows, cpu=time.process_time() - began[0])


def lines_in(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def start_cli_readers(
    transport: str, readers: int, port: int, ipc: Path, out: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """`changefeed stream --follow --from now --output F` per reader (``--local``: from the
    node's shared memory): the product's readers, JSON lines into a file each."""
    started = []
    for app in range(1, readers + 1):
        output = out / f"{transport}-{app}.jsonl"
        cmd = [
            str(Path(sys.executable).with_name("changefeed")), "stream", "--port", str(port),
            "--from", "now", "--follow", "--output", str(output),
        ]  # fmt: skip
        if transport == "shm":
            cmd += ["--local", "--shm-dir", str(ipc), "--app-id", str(app)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append((proc, output))
    return started


def run_live(
    transport: str, readers: int, keys: int, workdir: Path, *, cli: bool = False
) -> dict[str, float]:
    """Items/s delivered and total CPU us per delivered item (node + readers), the node
    publishing live changes from a writer (in this process: not counted). `cli`: the readers
    are `changefeed stream` processes writing JSON lines (their CPU from the first line)."""
    from changefeed.cli.node_process import NodeProcess
    from changefeed.consumer import KvClient

    ipc = workdir / f"live-ipc-{uuid.uuid4().hex[:6]}"
    args = ["--no-durable", "--log-level", "WARNING"]
    if transport == "shm":
        args += ["--shm", "1", "--shm-dir", str(ipc)]
    node = NodeProcess(
        workdir / f"live-{transport}-{readers}-{uuid.uuid4().hex[:4]}", vbuckets=16, args=args
    )
    node.start()
    value = b"v" * VALUE_BYTES

    async def write(first: int, count: int) -> None:
        async with await KvClient.connect("127.0.0.1", node.port) as kv:
            for start in range(first, first + count, 500):
                await asyncio.gather(
                    *(
                        kv.upsert(b"live%07d" % i, value)
                        for i in range(start, min(first + count, start + 500))
                    )
                )

    procs: list[subprocess.Popen[Any]] = []
    try:
        if cli:
            out = workdir / f"out-{uuid.uuid4().hex[:6]}"
            out.mkdir()
            pairs = start_cli_readers(transport, readers, node.port, ipc, out)
            procs = [proc for proc, _ in pairs]
            deadline = time.monotonic() + 120
            marker = 0
            while any(lines_in(path) == 0 for _, path in pairs):  # every reader is reading
                assert time.monotonic() < deadline, "the stream readers never started"
                asyncio.run(write(marker, 1))  # one key at a time until each has a line
                marker += 1
                time.sleep(0.5)
            time.sleep(0.3)
            base = [lines_in(path) for _, path in pairs]
            cpu0 = [cpu_seconds(proc.pid) for proc in procs]
            node0, start = cpu_seconds(node.pid), time.perf_counter()
            asyncio.run(write(1_000_000, keys))
            while any(lines_in(p) - b < keys for (_, p), b in zip(pairs, base, strict=True)):
                assert time.monotonic() - start < 600, "the stream readers fell silent"
                time.sleep(0.05)
            wall = time.perf_counter() - start
            node_cpu = cpu_seconds(node.pid) - node0
            reader_cpu = sum(cpu_seconds(proc.pid) - c for proc, c in zip(procs, cpu0, strict=True))
            rows = readers * keys
        else:
            procs = [
                spawn(
                    "--role",
                    "live-reader",
                    "--transport",
                    transport,
                    "--port",
                    str(node.port),
                    "--dir",
                    str(ipc),
                    "--app",
                    str(app),
                    "--count",
                    str(keys),
                    "--vbuckets",
                    "16",
                )
                for app in range(1, readers + 1)
            ]
            for proc in procs:
                read_json(proc)
            time.sleep(0.5)  # the shm group resumes within 0.1 s of its first reader
            node0, start = cpu_seconds(node.pid), time.perf_counter()
            asyncio.run(write(0, keys))
            reports = [read_json(proc, timeout_s=300) for proc in procs]
            wall = time.perf_counter() - start
            node_cpu = cpu_seconds(node.pid) - node0
            for proc in procs:
                proc.wait(30)
            rows = sum(r["rows"] for r in reports)
            assert rows == readers * keys, (rows, readers, keys)
            reader_cpu = sum(r["cpu"] for r in reports)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        node.stop(check=False)
    cpu = node_cpu + reader_cpu
    return {
        "items_s": rows / wall,
        "cpu_us": cpu / rows * 1e6,
        "node_cpu_us": node_cpu / rows * 1e6,
        "reader_cpu_us": reader_cpu / rows * 1e6,
        "node_us_key": node_cpu / keys * 1e6,
    }


def run_live_all(workdir: Path, keys: int, repeat: int, cli_keys: int) -> list[str]:
    lines = [
        f"## 2b. end to end: a writer upserting {keys:,} keys ({VALUE_BYTES}-byte values; "
        f"{cli_keys:,} for the stream CLI) into a node (16 vbuckets, --no-durable) that "
        "publishes them live; readers (processes) from now until they have every change; the "
        f"best of {repeat} by CPU (the writer's CPU is not counted; readers' CPU from ready)",
        "  rows: LocalStream batches (shm) / DcpClient frames -> ChangeRows (tcp); "
        "stream CLI: `changefeed stream --follow --output` JSON lines, with --local (shm)",
        f"{'readers':<14} {'n':>2} {'items/s (all)':>14} {'CPU us/item':>12} "
        f"{'node us/item':>13} {'readers us/item':>16} {'node us/key':>12}",
    ]
    found: dict[tuple[str, int], dict[str, float]] = {}
    plans = [("rows", keys, False), ("stream CLI", cli_keys, True)]
    for label, count, cli in plans:
        if not count:
            continue
        for readers in (1, 4):
            for transport in ("shm", "tcp", "tcp-cols") if not cli else ("shm", "tcp"):
                runs = [
                    run_live(transport, readers, count, workdir, cli=cli) for _ in range(repeat)
                ]
                top = min(runs, key=lambda r: r["cpu_us"])
                found[f"{label} {transport}", readers] = top
                lines.append(
                    f"{label + ' ' + transport:<14} {readers:>2} {top['items_s']:>14,.0f} "
                    f"{top['cpu_us']:>12.2f} {top['node_cpu_us']:>13.2f} "
                    f"{top['reader_cpu_us']:>16.2f} {top['node_us_key']:>12.2f}"
                )
    for label, _, _ in plans:
        if (f"{label} shm", 4) not in found:
            continue
        shm4, tcp4 = found[f"{label} shm", 4], found[f"{label} tcp", 4]
        ratio = tcp4["cpu_us"] / shm4["cpu_us"]
        readers_ratio = tcp4["reader_cpu_us"] / shm4["reader_cpu_us"]
        lines.append(
            f"{label}: 4 local readers use {ratio:.2f}x fewer CPU us per delivered item than 4 "
            f"TCP readers, node included (goal 3x: {'met' if ratio >= 3 else 'NOT met'}); "
            f"the readers alone {readers_ratio:.2f}x"
        )
        if (f"{label} tcp-cols", 4) in found:
            cols4 = found[f"{label} tcp-cols", 4]
            lines.append(
                f"{label}: against 4 TCP readers that only decode columns (no rows): "
                f"{cols4['cpu_us'] / shm4['cpu_us']:.2f}x, the readers alone "
                f"{cols4['reader_cpu_us'] / shm4['reader_cpu_us']:.2f}x"
            )
    return lines


# -- 3. node CPU per key, --shm on and no reader ------------------------------------------------


def node_cpu_per_key(workdir: Path, keys: int, shm: bool) -> float:
    """us of node CPU per ingested key (one client, 100-byte values, --no-durable)."""
    from changefeed.cli.node_process import NodeProcess
    from changefeed.consumer import KvClient
    from changefeed.server.shm_publisher import IDLE_AFTER_S

    name = f"node-{'shm' if shm else 'plain'}-{uuid.uuid4().hex[:6]}"
    args = ["--no-durable", "--log-level", "WARNING"]
    if shm:
        args += ["--shm", "2", "--shm-dir", str(workdir / "idle-ipc")]
    node = NodeProcess(workdir / name, vbuckets=16, args=args)
    node.start()
    try:
        time.sleep(IDLE_AFTER_S + 0.5)  # the groups pause with no reader

        async def load() -> float:
            async with await KvClient.connect("127.0.0.1", node.port) as kv:
                value = b"v" * VALUE_BYTES
                cpu0 = cpu_seconds(node.pid)
                for start in range(0, keys, 500):
                    await asyncio.gather(
                        *(
                            kv.upsert(b"key%07d" % i, value)
                            for i in range(start, min(keys, start + 500))
                        )
                    )
                await asyncio.sleep(0.3)  # the flusher's share of the load
                return cpu_seconds(node.pid) - cpu0

        return asyncio.run(load()) / keys * 1e6
    finally:
        node.stop(check=False)


def run_idle(workdir: Path, keys: int, repeat: int) -> list[str]:
    plain: list[float] = []
    shm: list[float] = []
    for _ in range(repeat):  # alternating: both see the same machine load
        plain.append(node_cpu_per_key(workdir, keys, shm=False))
        shm.append(node_cpu_per_key(workdir, keys, shm=True))
    best = min(shm) - min(plain)
    median = float(np.median(shm) - np.median(plain))

    def runs(values: list[float]) -> str:
        return ", ".join(f"{v:.2f}" for v in values)

    # The node's CPU is read in clock ticks (10 ms): keys x 20 us makes the resolution
    # ~0.2 us/key at 60k keys; on a shared machine the run-to-run spread is larger still.
    return [
        f"## 3. node CPU per ingested key, {keys:,} upserts, {repeat} alternating runs",
        f"--shm off:               best {min(plain):6.2f}, median {np.median(plain):6.2f} "
        f"us/key  ({runs(plain)})",
        f"--shm 2, no reader:      best {min(shm):6.2f}, median {np.median(shm):6.2f} "
        f"us/key  ({runs(shm)})",
        f"cost of --shm with no reader: {median:+.2f} us/key (medians), {best:+.2f} (bests); "
        f"goal <= 0.3: {'met' if median <= 0.3 else 'NOT met'} by the medians "
        "(before issue 27: +12 us/key in the issue, +29 with this bench)",
    ]


# -- 4. recovery --------------------------------------------------------------------------------


def role_holder(args: argparse.Namespace) -> None:
    """Subscribe (timing it), hold 2 batches, report, sleep until killed (or exit if asked)."""
    start = time.perf_counter()
    sub = subscribe(args.service, directory=args.dir, app_id=args.app, max_samples=2, start=1)
    took = time.perf_counter() - start
    held = [sub.receive(5.0), sub.receive(5.0)]
    rollback = sub.report.rollback
    emit(
        subscribe_s=took,
        held=[s.slot for s in held if s is not None],
        rolled_back=rollback.rolled_back,
        released=rollback.released_slots,
    )
    if args.batches == 0:
        for sample in held:
            if sample is not None:
                sample.release()
        sub.close()
        return
    while True:
        time.sleep(1)


def role_provider(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    provider = Provider.offer(args.service, GEOMETRY, directory=args.dir)
    offered = time.perf_counter() - start
    emit(
        offer_s=offered,
        reused=provider.report.reused,
        cleaned=provider.report.cleaned_in_writing,
        at=time.time(),
    )
    message = change_batch(64).serialize()
    positions = np.zeros((len(GROUP), 5), np.uint64)
    while True:
        provider.handle_control()
        provider.publish(message, positions, rows=64)
        time.sleep(0.001)


def role_follower(args: argparse.Namespace) -> None:
    """Read forever; after a pause of over 50 ms report when batches came back."""
    sub = subscribe(args.service, directory=args.dir, app_id=args.app, max_samples=1)
    emit(ready=True)
    last = time.time()
    while True:
        sample = sub.receive(5.0)
        if sample is None:
            continue
        now = time.time()
        if now - last > 0.05:
            emit(resumed_at=now, gap_s=now - last, seq=sample.seq)
        last = now
        sample.release()


def run_recovery(directory: str) -> list[str]:
    lines = []
    service = f"bench{uuid.uuid4().hex[:10]}"
    provider = Provider.offer(service, GEOMETRY, directory=directory)
    try:
        message = change_batch(64).serialize()
        positions = np.zeros((len(GROUP), 5), np.uint64)
        for _ in range(4):
            provider.publish(message, positions, rows=64)
        holder = spawn(
            "--role",
            "holder",
            "--service",
            service,
            "--dir",
            directory,
            "--app",
            "7",
            "--batches",
            "1",
        )
        first = read_json(holder)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        held_before = provider.subscription()
        restart = spawn(
            "--role",
            "holder",
            "--service",
            service,
            "--dir",
            directory,
            "--app",
            "7",
            "--batches",
            "0",
        )
        report = read_json(restart)
        restart.wait(30)
        after = provider.subscription()
        lines.append(
            f"reader killed holding {len(first['held'])} batches: its restart's subscribe "
            f"{report['subscribe_s'] * 1e3:.1f} ms (rollback of the dead log "
            f"{report['rolled_back']}, {report['released']} slots released); budget held by the "
            "dead reader "
            f"{held_before} -> {after} after the restart closed"
        )
    finally:
        provider.stop_offer()
    service = f"bench{uuid.uuid4().hex[:10]}"
    producer = spawn("--role", "provider", "--service", service, "--dir", directory)
    read_json(producer)
    follower = spawn("--role", "follower", "--service", service, "--dir", directory, "--app", "3")
    read_json(follower)
    time.sleep(0.3)
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    time.sleep(0.2)
    restarted_at = time.time()
    producer = spawn("--role", "provider", "--service", service, "--dir", directory)
    offer = read_json(producer)
    resumed = read_json(follower)
    offered_ms = 1e3 * (offer["at"] - restarted_at)
    lines.append(
        f"provider killed mid-stream: restart -> offered {offered_ms:.0f} ms (interpreter start "
        f"included; the offer itself {offer['offer_s'] * 1e3:.1f} ms, segments reused: "
        f"{offer['reused']}, IN_WRITING cleaned: {offer['cleaned']}); offered -> readers' next "
        f"batch {1e3 * (resumed['resumed_at'] - offer['at']):.1f} ms; "
        f"-> readers' next batch {1e3 * (resumed['resumed_at'] - restarted_at):.0f} ms"
    )
    for proc in (producer, follower):
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    paths = ServicePaths(service, directory)
    Segment.unlink(paths.control_segment)
    Segment.unlink(paths.data_segment)
    return lines


# -- main ---------------------------------------------------------------------------------------


def machine() -> list[str]:
    model = "unknown"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}  (cwd {Path.cwd()})",
        f"machine: nproc {len(os.sched_getaffinity(0))}, {model}, {platform.platform()}; "
        f"load average {load}",
        f"python: {platform.python_implementation()} {platform.python_version()}; "
        f"pyarrow {pa.__version__}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role")
    parser.add_argument("--service")
    parser.add_argument("--dir")
    parser.add_argument("--app", type=int, default=1)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--port", type=int)
    parser.add_argument("--vbuckets", type=int, default=16)
    parser.add_argument("--dcp-items", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5, help="fan-out runs; the best is shown")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--section", choices=["all", "idle", "live"], default="all")
    parser.add_argument("--transport", choices=["shm", "tcp", "tcp-cols"], default="shm")
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--live-keys", type=int, default=50_000)
    parser.add_argument("--live-repeat", type=int, default=2)
    parser.add_argument("--cli-keys", type=int, default=20_000, help="0: no stream CLI rows")
    parser.add_argument("--idle-keys", type=int, default=50_000)
    parser.add_argument("--idle-repeat", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    roles = {
        "shm-reader": role_shm_reader,
        "iox-reader": role_iox_reader,
        "dcp-reader": role_dcp_reader,
        "live-reader": role_live_reader,
        "holder": role_holder,
        "provider": role_provider,
        "follower": role_follower,
    }
    if args.role:
        roles[args.role](args)
        return
    if args.quick:
        args.batches, args.dcp_items, args.idle_keys, args.idle_repeat = 60, 20_000, 10_000, 1
    if args.quick:
        args.live_keys, args.live_repeat, args.cli_keys = 10_000, 1, 3_000
    if args.section == "live":
        with tempfile.TemporaryDirectory(prefix="bench-ipc-") as work:
            lines = run_live_all(Path(work), args.live_keys, args.live_repeat, args.cli_keys)
            print("\n".join([*machine(), *lines]))
        return
    if args.section == "idle":
        with tempfile.TemporaryDirectory(prefix="bench-ipc-") as work:
            print("\n".join([*machine(), *run_idle(Path(work), args.idle_keys, args.idle_repeat)]))
        return
    began = time.perf_counter()
    out = [*machine(), ""]
    lines, chosen = bench_atomics(20_000 if args.quick else 200_000)
    out += [
        "## 1. atomics from Python (ns per operation; per batch: what a reader does per batch)",
        *lines,
        f"chosen: {chosen} (the fastest that loads; atomics is ~100x slower and needs a view "
        "object per field)",
        "",
    ]
    print("\n".join(out), flush=True)
    table = [
        f"## 2. fan-out: {ROWS} change rows of {VALUE_BYTES}-byte values per batch, "
        f"{args.batches} batches per reader (shm, iceoryx2); {args.dcp_items:,} items per "
        "reader (DCP)",
        f"{'transport':<12} {'readers':>7} {'items/s (all readers)':>22} {'slowest run':>16} "
        f"{'CPU us/item':>12} {'vs TCP':>8}",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as work:
        directory = str(Path(work) / "ipc")
        shm, iox, paired = {}, {}, {}
        for r in (1, 4):  # shm and iceoryx2 runs alternate, so both see the same machine load
            runs = [
                (run_shm(r, args.batches, directory), run_iceoryx2(r, args.batches))
                for _ in range(args.repeat)
            ]
            shm[r] = best([a for a, _ in runs])
            iox[r] = best([b for _, b in runs if b is not None])
            ratios = sorted(a["items_s"] / b["items_s"] for a, b in runs if b is not None)
            paired[r] = ratios[len(ratios) // 2] if ratios else None
        dcp = run_dcp_all(args.dcp_items, [1, 4], Path(work))
        for r in (1, 4):
            for name, res in (("shm", shm[r]), ("iceoryx2", iox[r]), ("TCP DCP", dcp[r])):
                if res is None:
                    table.append(f"{name:<12} {r:>7} {'(not installed)':>22}")
                    continue
                ratio = res["items_s"] / dcp[r]["items_s"]
                slowest = f"{res['worst_items_s']:,.0f}" if "worst_items_s" in res else "-"
                table.append(
                    f"{name:<12} {r:>7} {res['items_s']:>22,.0f} {slowest:>16} "
                    f"{res['cpu_us']:>12.4f} {ratio:>7.1f}x"
                )
        s4, d4 = shm[4]["items_s"], dcp[4]["items_s"]
        goals = [
            f"goal >= 5M items/s to 4 readers: {s4 / 1e6:.1f}M "
            f"({'met' if s4 >= 5e6 else 'NOT met'})",
            f"goal >= 5x TCP: {s4 / d4:.0f}x ({'met' if s4 >= 5 * d4 else 'NOT met'})",
        ]
        for r in (1, 4):
            if iox[r] is not None and paired[r] is not None:
                cpu = shm[r]["cpu_us"] / iox[r]["cpu_us"]
                verdict = "met" if paired[r] >= 0.5 and cpu <= 2 else "NOT met"
                goals.append(
                    f"goal within 2x of iceoryx2, {r} reader(s): items/s shm/iceoryx2 "
                    f"{paired[r]:.2f} (median of paired runs), CPU per item {cpu:.2f}x ({verdict})"
                )
        table += goals
        node = run_node_publisher(args.dcp_items, Path(work))
        table.append(
            f"node publisher (in-process producer -> rows from the items -> ring), one group of 16 "
            f"vbuckets: {node['rows_s']:,.0f} rows/s, {node['cpu_us']:.2f} us CPU per row "
            f"({1e6 / node['cpu_us']:,.0f} rows per CPU-second), once for all local readers "
            f"({node['batches']:.0f} batches); goal >= 1M rows/s: "
            f"{'met' if node['rows_s'] >= 1e6 else 'NOT met'} (wall), "
            f"{'met' if node['cpu_us'] <= 1.0 else 'NOT met'} (per CPU-second)"
        )
        table.append(
            f"publisher CPU per item delivered (shm, 4 readers): "
            f"{shm[4]['publisher_cpu_us']:.3f} us; node CPU per item (DCP, 4 readers): "
            f"{dcp[4]['server_cpu_us']:.3f} us"
        )
        print("\n".join(table), flush=True)
        live = ["", *run_live_all(Path(work), args.live_keys, args.live_repeat, args.cli_keys)]
        print("\n".join(live), flush=True)
        table += live
        idle = ["", *run_idle(Path(work), args.idle_keys, args.idle_repeat)]
        print("\n".join(idle), flush=True)
        table += idle
        recovery = ["", "## 4. recovery after kill -9", *run_recovery(directory)]
        print("\n".join(recovery), flush=True)
    total = f"\n(run took {time.perf_counter() - began:.0f} s)"
    print(total)
    if not args.no_save and not args.quick:
        RESULTS.write_text("\n".join([*out, *table, *recovery, total, ""]))


if __name__ == "__main__":
    main()
