"""Codec benchmark: DCP mutation frames (16-byte keys, 100-byte values), items per second.

Paths timed, each over the same encoded stream:

* ``encode_mutation`` per item (``Mutation`` objects built beforehand, not timed);
* ``FrameReader.next_frame`` + ``decode_mutation`` per item, the stream fed in chunks the way a
  socket delivers it;
* ``FrameReader.read_batch`` → ``ChangeColumns`` (the consumer hot path), with each of
  ``decode_batch``'s two decoders forced (per frame: pure Python, one unpack per item; numpy:
  one walk step per frame, then array operations) and as it picks by size (what consumers run);
* ``read_batch`` → change rows → ``pyarrow.RecordBatch`` (``consumer/change_rows.py``, the
  conversion every Arrow reader uses: Spark's data source, the ipc fan-out);
* the same-run peer: a plain ``struct.unpack_from`` loop over the whole buffer doing the minimum
  a parser must do (unpack header + extras, slice key and value, keep them) — the "plain parse
  loop" ARCHITECTURE.md quotes at about 0.45M items/s. Every row is also given as a ratio to it.

Each row shows wall-clock seconds, items/s, the ratio to the plain loop and the CPU time per item
(``time.process_time``, this process): on a shared machine the wall clock moves with the other
load, the CPU time per item much less.

Usage::

    .venv/bin/python bench/bench_codec.py               # 1,000,000 items
    .venv/bin/python bench/bench_codec.py --quick       # 50,000 items, for a smoke run
    .venv/bin/python bench/bench_codec.py --items 200000 --repeat 5

Each path runs ``--repeat`` times and the best time is reported (least disturbed by the rest of
the machine), with the cyclic GC off while timing, as ``timeit`` does (``--gc`` leaves it on).
Every run checks what it decoded, so a fast wrong path cannot win.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA, ChangeRows
from changefeed.protocol.dcp_items import (
    MUTATION_PREFIX,
    Mutation,
    decode_mutation,
    encode_mutation,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.reader import NEED_DATA, FrameReader

KEY_BYTES = 16
VALUE_BYTES = 100
CHUNK_BYTES_DEFAULT = 256 * 1024
VBUCKETS = 1024  # build_mutations spreads the items over this many vbuckets
# Header + mutation extras in one struct, as the plain loop would write it (the protocol's own
# declaration: the layout is declared once, in protocol/dcp_items.py).
PLAIN = MUTATION_PREFIX
PLAIN_SIZE = PLAIN.size
assert PLAIN_SIZE == 24 + 31


def build_mutations(items: int) -> list[Mutation]:
    value = bytes(range(VALUE_BYTES))
    return [
        Mutation(
            vbucket=seqno % VBUCKETS,
            opaque=7,
            seqno=seqno,
            key=b"key-%012d" % seqno,
            value=value,
            cas=seqno << 16,
            rev_seqno=1,
            flags=0x02000000,
        )
        for seqno in range(1, items + 1)
    ]


def split(wire: bytes, chunk_bytes: int) -> list[bytes]:
    return [wire[pos : pos + chunk_bytes] for pos in range(0, len(wire), chunk_bytes)]


# -- the timed paths: each returns (items, last seqno) for the check ------------------------------


def run_encode(mutations: list[Mutation]) -> tuple[int, bytes]:
    encode = encode_mutation
    frames = [encode(m) for m in mutations]
    return len(frames), frames[-1]


def run_plain_loop(wire: bytes) -> tuple[int, int]:
    unpack_from = PLAIN.unpack_from
    out = []
    append = out.append
    pos = 0
    end = len(wire)
    while pos < end:  # bounded: each frame advances pos by >= 55 bytes
        fields = unpack_from(wire, pos)
        keylen = fields[2]
        key_at = pos + PLAIN_SIZE
        value_at = key_at + keylen
        pos += 24 + fields[6]
        append((fields[9], wire[key_at:value_at], wire[value_at:pos]))
    return len(out), out[-1][0]


def run_per_item(chunks: list[bytes]) -> tuple[int, int]:
    reader = FrameReader()
    decode = decode_mutation
    out = []
    append = out.append
    for chunk in chunks:
        reader.feed(chunk)
        while True:  # bounded by the chunk: each frame consumes >= 55 bytes
            frame = reader.next_frame()
            if frame is NEED_DATA:
                break
            assert isinstance(frame, Frame)
            append(decode(frame))
    assert reader.buffered_bytes == 0
    return len(out), out[-1].seqno


def run_batch(chunks: list[bytes], vectorise: bool | None) -> tuple[int, int]:
    reader = FrameReader()
    columns = []
    count = 0
    for chunk in chunks:
        reader.feed(chunk)
        batch = reader.read_batch(vectorise=vectorise)
        count += len(batch.changes)
        columns.append(batch.changes)
    assert reader.buffered_bytes == 0
    return count, int(columns[-1].array("seqno")[-1])


def run_arrow(chunks: list[bytes], items: int) -> tuple[int, int]:
    reader = FrameReader()
    batches = []
    snapshots = dict.fromkeys(range(VBUCKETS), (1, items))  # one snapshot holding every item
    for chunk in chunks:
        reader.feed(chunk)
        changes = reader.read_batch().changes
        if not len(changes):
            continue
        rows = ChangeRows()
        rows.append_changes(changes, snapshots)
        batches.append(rows.to_batch())
    assert reader.buffered_bytes == 0
    assert all(b.schema == CHANGE_ROW_SCHEMA for b in batches)
    count = sum(b.num_rows for b in batches)
    return count, batches[-1].column("seqno")[-1].as_py()


# -- harness --------------------------------------------------------------------------------------


def best_time(run: Callable[[], Any], repeat: int, *, gc_on: bool) -> tuple[float, float, Any]:
    """Best wall-clock seconds, best CPU seconds (of the same runs) and the last result."""
    best = best_cpu = float("inf")
    result = None
    for _ in range(repeat):
        result = None  # free the previous run's output before timing the next
        gc.collect()
        # As timeit does: no cyclic GC while timing. Every path keeps its 1M outputs alive, and
        # with GC on, the generation-2 walks over them would be charged to whichever path
        # allocates the most tracked objects rather than to the codec.
        if not gc_on:
            gc.disable()
        try:
            started, started_cpu = time.perf_counter(), time.process_time()
            result = run()
            best_cpu = min(best_cpu, time.process_time() - started_cpu)
            best = min(best, time.perf_counter() - started)
        finally:
            gc.enable()
    return best, best_cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="mutations (default 1M)")
    parser.add_argument("--quick", action="store_true", help="50,000 items, 1 repeat")
    parser.add_argument("--repeat", type=int, default=3, help="runs per path; best is shown")
    parser.add_argument("--gc", action="store_true", help="keep the cyclic GC on while timing")
    parser.add_argument(
        "--chunk-bytes", type=int, default=CHUNK_BYTES_DEFAULT, help="bytes per feed()"
    )
    args = parser.parse_args()
    items = 50_000 if args.quick else args.items
    repeat = 1 if args.quick else args.repeat
    assert items > 0, items
    assert repeat > 0, repeat

    mutations = build_mutations(items)
    wire = b"".join(encode_mutation(m) for m in mutations)
    frame_bytes = len(wire) // items
    assert frame_bytes == 24 + 31 + KEY_BYTES + VALUE_BYTES, frame_bytes
    chunks = split(wire, args.chunk_bytes)
    run_arrow([wire[: frame_bytes * 16]], items)  # untimed: pyarrow sets up on first use
    gc.freeze()  # the inputs above live for the whole run; keep them out of the GC's walks

    paths: list[tuple[str, Callable[[], Any]]] = [
        ("plain struct.unpack_from loop (peer)", lambda: run_plain_loop(wire)),
        ("encode_mutation, per item", lambda: run_encode(mutations)),
        ("next_frame + decode_mutation, per item", lambda: run_per_item(chunks)),
        ("read_batch -> ChangeColumns, per frame", lambda: run_batch(chunks, False)),
        ("read_batch -> ChangeColumns, numpy", lambda: run_batch(chunks, True)),
        ("read_batch -> ChangeColumns (by size)", lambda: run_batch(chunks, None)),
        ("read_batch -> change rows (Arrow)", lambda: run_arrow(chunks, items)),
    ]
    rows = []
    for name, run in paths:
        seconds, cpu_seconds, (count, last) = best_time(run, repeat, gc_on=args.gc)
        assert count == items, (name, count, items)
        if isinstance(last, bytes):
            assert last == encode_mutation(mutations[-1]), name
        else:
            assert last == items, (name, last)
        rows.append((name, seconds, items / seconds, cpu_seconds / items * 1e6))

    baseline = rows[0][2]
    print(
        f"codec benchmark: {items:,} DCP mutations, key {KEY_BYTES} B, value {VALUE_BYTES} B, "
        f"{frame_bytes} B/frame, fed in {args.chunk_bytes:,} B chunks, best of {repeat}, "
        f"cyclic GC {'on' if args.gc else 'off'} while timing"
    )
    print(f"Python {platform.python_version()} ({platform.machine()}), pyarrow {pa.__version__}")
    print()
    print(f"{'path':<42} {'seconds':>9} {'items/s':>12} {'vs plain loop':>14} {'CPU us/item':>12}")
    print("-" * 93)
    for name, seconds, rate, cpu_us in rows:
        print(
            f"{name:<42} {seconds:>9.3f} {rate / 1e6:>10.3f}M {rate / baseline:>13.2f}x "
            f"{cpu_us:>12.3f}"
        )


if __name__ == "__main__":
    main()
