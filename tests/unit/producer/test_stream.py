"""``Stream`` over runs: from disk (stored records framed as stored) and from memory (items framed
from their bodies) the same items go out byte for byte, for each connection option, however the
pump's byte budget cuts the runs; flow control counts exactly the bytes written."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted
from changefeed.protocol.dcp import OpenFlag, StreamRequest
from changefeed.protocol.frame import HEADER
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import MarkerFlag, decode_snapshot_marker
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig

SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
VBS = (0, 1)
ITEM_OPCODES = (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)
MemoryFrames = dict[int, dict[int, list[bytes]]]  # flags -> vb -> item frames from memory
FLAGS = [
    OpenFlag.PRODUCER,
    OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES,
    OpenFlag.PRODUCER | OpenFlag.NO_VALUE,
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(bucket: Bucket, count: int) -> None:
    """Mutations of varied sizes, some overwritten (gaps on disk), deletions and xattrs."""
    for vb in VBS:
        vbucket = bucket.vbucket(vb)
        for n in range(count):
            vbucket.set(b"key%d" % (n % 11), b"v" * (n * 37 % 300), flags=n)
            if n % 9 == 4:
                vbucket.delete(b"key%d" % (n % 11))


def open_bucket(path: Path) -> Bucket:
    config = NodeConfig(data_dir=path, vbuckets=4, durable=False)
    return Bucket.open(config, clock=FakeClock(), rng=random.Random(5))


def close_bucket(bucket: Bucket) -> None:
    for vbucket in bucket.vbuckets.values():
        vbucket.close()  # flushes what is queued
    bucket.store.close()


def stream_all(bucket: Bucket, flags: int, budgets: Iterator[int]) -> tuple[list[bytes], int]:
    """Every vb of VBS streamed from 0 to its high seqno; (the output, bytes flow control
    counted with a window far above the output)."""
    p = DcpProducer("test", flags, source=bucket, clock=FakeClock())
    assert p.control("connection_buffer_size", str(2**31))[0] == 0
    for vb in VBS:
        high = bucket.vbucket(vb).high_seqno
        assert isinstance(p.stream_request(StreamRequest(vb, vb, 0, 0, high, 0, 0, 0)), Accepted)
    out: list[bytes] = []
    for budget in budgets:  # bounded by the caller's budgets
        if not p.ready:
            break
        p.pump(out, budget)
    assert not p.ready, "budgets ran out before the streams were drained"
    return out, p.flow.outstanding_bytes


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(opaque, opcode, frame bytes) of every frame, checked to be well formed."""
    reader = FrameReader(64 * 1024 * 1024)
    reader.feed(data)
    found = []
    at = 0
    while (frame := reader.next_frame()) is not NEED_DATA:
        size = HEADER.size + HEADER.unpack_from(data, at)[6]
        found.append((frame.opaque, frame.opcode, data[at : at + size]))  # type: ignore[union-attr]
        at += size
    assert at == len(data)
    return found


def item_frames(found: list[tuple[int, int, bytes]]) -> dict[int, list[bytes]]:
    per_vb: dict[int, list[bytes]] = {vb: [] for vb in VBS}
    for opaque, opcode, frame in found:
        if opcode in ITEM_OPCODES:
            per_vb[opaque].append(frame)
    return per_vb


def per_stream(found: list[tuple[int, int, bytes]]) -> dict[int, list[bytes]]:
    streams: dict[int, list[bytes]] = {vb: [] for vb in VBS}
    for opaque, _, frame in found:
        streams[opaque].append(frame)
    return streams


def marker_flags(found: list[tuple[int, int, bytes]]) -> set[int]:
    flags = set()
    reader = FrameReader(1 << 20)
    for _, opcode, frame in found:
        if opcode == Opcode.DCP_SNAPSHOT_MARKER:
            reader.feed(frame)
            decoded = reader.next_frame()
            flags.add(decode_snapshot_marker(decoded).flags)  # type: ignore[arg-type]
    return flags


@pytest.fixture(scope="module")
def memory_then_disk(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, MemoryFrames]]:
    """A bucket's data dir, and each flag set's item frames streamed from memory."""
    path = tmp_path_factory.mktemp("bucket")
    bucket = open_bucket(path)
    write(bucket, 120)
    from_memory: MemoryFrames = {}
    for flags in FLAGS:
        out, counted = stream_all(bucket, flags, iter([1 << 30] * 4))
        found = frames(b"".join(out))
        assert counted == sum(map(len, out))  # flow control counted exactly what was written
        assert marker_flags(found) <= {MarkerFlag.MEMORY | MarkerFlag.CHECKPOINT, MarkerFlag.MEMORY}
        from_memory[flags] = item_frames(found)
    close_bucket(bucket)
    yield path, from_memory


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    budgets=st.lists(st.integers(1, 2000), min_size=1, max_size=20),
    flags=st.sampled_from(FLAGS),
)
def test_disk_streams_send_the_memory_streams_items_however_cut(
    memory_then_disk: tuple[Path, MemoryFrames], budgets: list[int], flags: int
) -> None:
    path, from_memory = memory_then_disk
    bucket = open_bucket(path)  # memory is empty: every stream is a backfill
    try:
        out, counted = stream_all(bucket, flags, cycle(budgets))
        found = frames(b"".join(out))
        assert counted == sum(map(len, out))
        assert marker_flags(found) == {MarkerFlag.DISK}
        disk_items = item_frames(found)
        # The store keeps each key's newest version: the disk stream is the memory stream's
        # items without those a later write of the same key replaced.
        for vb in VBS:
            memory_items = from_memory[flags][vb]
            assert disk_items[vb] == [f for f in memory_items if f in disk_items[vb]]
            assert len(disk_items[vb]) == 11  # one per key
        whole, _ = stream_all(bucket, flags, iter([1 << 30] * 4))
        assert per_stream(found) == per_stream(frames(b"".join(whole)))  # streams interleave
    finally:
        close_bucket(bucket)


def cycle(budgets: list[int]) -> Iterator[int]:
    for _ in range(100_000):  # bounded: enough rounds for any drained test stream
        yield from budgets
