"""Stream benchmark, sans IO: a DcpProducer's pump over a real bucket, from memory and from disk.

Rows (CPU time with ``time.process_time`` and wall time with ``time.perf_counter``, cyclic GC
off while timing; each row runs ``--repeat`` times, the best run is shown with the median):

* memory, runs: ``DcpProducer.pump`` of 4 streams (4 vbuckets, from seqno 0 to the end) into a
  list, everything in the checkpoints (nothing flushed). What the node's DCP pump does per wake,
  minus the socket: reader runs, stream machine, framing. Each item is framed from the body it
  carries (checkpoint/item.py), a run of items joined once.
* memory, per-item peer: the same items through the per-item path runs replaced, in the same
  process: ``StreamReader.read`` event by event, and per item one frame built (one
  ``struct.pack`` of header and extras, then a join with key and value) and appended to the
  output on its own, as producer/item_encoding.py did before. Its value is now a slice of the
  item's body (an attribute of its own before), so the peer is a little slower than the old
  code was; compare with an older tree for exact before-numbers.
* disk, runs: the same pump after the bucket was flushed, closed and reopened, so memory is
  empty and every stream is a disk backfill: stored records framed as LMDB holds them (runs of
  ``Store.scan_bodies`` inside one read transaction), none decoded.
* disk, per-item peer: per item, a record decoded and checked (``BodyScan.next_record``), an
  ``Item`` built from it (sharing the record's body), then framed as above.

Every run checks what it produced: the number of items, and that the runs' item frames equal
the peer's byte for byte. Disk rows read a store the page cache already holds (the first run
warms it); they measure CPU, not the drive.

Usage::

    .venv/bin/python bench/bench_stream.py             # 200,000 items
    .venv/bin/python bench/bench_stream.py --quick     # 20,000 items, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from changefeed.checkpoint import CursorKind, Item, SnapshotStart
from changefeed.producer.item_encoding import ItemOptions, encode_item
from changefeed.producer.producer import DcpProducer
from changefeed.protocol.dcp import OpenFlag, StreamRequest
from changefeed.protocol.dcp_items import MUTATION_PREFIX
from changefeed.protocol.frame import HEADER
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import SnapshotMarker, encode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.storage import Op

VBUCKETS = 4
VALUE_BYTES = 100
SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
PUMP_BYTES = 1 << 20  # what the node's pump asks per wake (limits.PUMP_BYTES_MAX)
PEER_RUN_EVENTS = 64  # the per-item peer reads like the stream did (limits.STREAM_RUN_EVENTS_MAX)
ITEM_OPCODES = (int(Opcode.DCP_MUTATION), int(Opcode.DCP_DELETION))


def load(config: NodeConfig, count: int) -> Bucket:
    """A bucket holding `count` mutations with unique keys, spread over the vbuckets."""
    bucket = Bucket.open(config)
    vbuckets = [bucket.vbuckets[vb] for vb in range(VBUCKETS)]
    for n in range(count):
        vbuckets[n % VBUCKETS].set(b"key%08d" % n, b"%0100d" % n)
    return bucket


def pump_runs(bucket: Bucket) -> list[bytes]:
    """The producer path: 4 streams from 0 to the end, pumped until done."""
    producer = DcpProducer("bench", OpenFlag.PRODUCER, source=bucket)
    for vb in range(VBUCKETS):
        producer.stream_request(StreamRequest(vb, vb, 0, 0, SEQNO_FOREVER, 0, 0, 0))
    out: list[bytes] = []
    while producer.ready:  # bounded by the items stored
        producer.pump(out, PUMP_BYTES)
    producer.close()
    return out


def pump_per_item(bucket: Bucket) -> list[bytes]:
    """The per-item peer: event by event from the readers, one frame per item appended."""
    readers = [
        bucket.open_reader(
            vb,
            f"peer:{vb}",
            0,
            kind=CursorKind.STREAM,
            droppable=True,
            end_seqno=bucket.vbucket(vb).high_seqno,
        )
        for vb in range(VBUCKETS)
    ]
    out: list[bytes] = []
    live = list(range(VBUCKETS))
    while live:  # round-robin like the pump; bounded by the items stored
        for vb in list(live):
            events = readers[vb].read(PEER_RUN_EVENTS)
            if not events:
                live.remove(vb)
            for event in events:  # bounded by the run
                out.append(_frame_one(event, vb, opaque=vb))
    for reader in readers:
        reader.close()
    return out


_pack_prefix = MUTATION_PREFIX.pack  # header and mutation extras in one struct
_MAGIC = int(Magic.REQUEST)
_OP_MUTATION = int(Opcode.DCP_MUTATION)
_MUTATION = Op.MUTATION
_OPTIONS = ItemOptions()


def _frame_one(event: Item | SnapshotStart, vb: int, opaque: int) -> bytes:
    """One frame for one event: the per-item framing the run framing replaced."""
    if isinstance(event, SnapshotStart):
        marker = SnapshotMarker(vb, opaque, event.snap_start, event.snap_end, event.flags)
        return encode_snapshot_marker(marker)
    if event.op is not _MUTATION:
        return encode_item(event, vb, opaque, _OPTIONS)
    key = event.key
    value = event.value  # a slice of the body today; an attribute of its own before
    prefix = _pack_prefix(
        _MAGIC,
        _OP_MUTATION,
        len(key),
        31,
        event.datatype,
        vb,
        31 + len(key) + len(value),
        opaque,
        event.cas,
        event.seqno,
        event.rev_seqno,
        event.flags,
        event.expiry,
        0,
        0,
        0,
    )
    return b"".join((prefix, key, value))


def item_frames(out: list[bytes]) -> dict[int, list[bytes]]:
    """The item frames of `out`, per opaque (= vbucket), in order; markers and ends skipped."""
    data = b"".join(out)
    frames: dict[int, list[bytes]] = {vb: [] for vb in range(VBUCKETS)}
    at = 0
    while at < len(data):  # bounded by the data
        _, opcode, _, _, _, _, bodylen, opaque, _ = HEADER.unpack_from(data, at)
        end = at + HEADER.size + bodylen
        if opcode in ITEM_OPCODES:
            frames[opaque].append(data[at:end])
        at = end
    assert at == len(data), (at, len(data))
    return frames


def timed(run: Callable[[Bucket], list[bytes]], bucket: Bucket) -> tuple[float, float, list[bytes]]:
    """(CPU seconds, wall seconds, output) of one run, GC off."""
    gc.collect()
    gc.disable()
    try:
        wall = time.perf_counter()
        cpu = time.process_time()
        out = run(bucket)
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - wall
    finally:
        gc.enable()
    return cpu, wall, out


def measure(
    label: str, run: Callable[[Bucket], list[bytes]], bucket: Bucket, count: int, repeat: int
) -> tuple[str, dict[int, list[bytes]]]:
    """A table row for `run`, and the item frames of its last run (checked to hold `count`)."""
    cpus: list[float] = []
    walls: list[float] = []
    frames: dict[int, list[bytes]] = {}
    for _ in range(repeat):
        cpu, wall, out = timed(run, bucket)
        frames = item_frames(out)
        assert sum(map(len, frames.values())) == count, (label, count)
        cpus.append(cpu)
        walls.append(wall)
    best_cpu = min(cpus) / count * 1e6
    median_cpu = statistics.median(cpus) / count * 1e6
    rate = count / min(walls)
    row = f"{label:<34} {rate:>14,.0f} {best_cpu:>12.3f} {median_cpu:>12.3f}"
    return row, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 items")
    parser.add_argument("--items", type=int, default=None, help="items per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per row")
    args = parser.parse_args()
    count = args.items or (20_000 if args.quick else 200_000)
    print(
        f"# bench_stream: {count:,} items over {VBUCKETS} vbuckets, 11-byte keys, "
        f"{VALUE_BYTES}-byte values; best of {args.repeat} (median beside it)"
    )
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}")
    print()
    print(f"{'path':<34} {'items/s':>14} {'CPU us/item':>12} {'median':>12}")
    print("-" * 75)
    directory = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        config = NodeConfig(
            data_dir=directory, vbuckets=VBUCKETS, durable=False, checkpoint_quota_bytes=2**31
        )
        bucket = load(config, count)
        for source in ("memory", "disk"):
            if source == "disk":
                asyncio.run(bucket.close())  # flushes everything, then memory starts empty
                bucket = Bucket.open(config)
                assert all(v.manager.memory_bytes == 0 for v in bucket.vbuckets.values())
            row, runs = measure(f"{source}, runs", pump_runs, bucket, count, args.repeat)
            print(row)
            row, peer = measure(
                f"{source}, per-item peer", pump_per_item, bucket, count, args.repeat
            )
            print(row)
            assert runs == peer, f"{source}: the runs' item frames differ from the peer's"
        asyncio.run(bucket.close())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
