"""Write-path benchmark, in process: what a node spends per change it takes, minus the socket.

Rows (CPU time with ``time.process_time``; each row runs ``--repeat`` times on a fresh bucket
and the best run is shown; the node's interpreter settings, ``server/node.py``
``tune_interpreter``, apply while timing, as in a node process):

* replica apply: ``ReplicaFeed._on_push`` of decoded DCP batches (one per vbucket, 16
  vbuckets, a memory snapshot each), what a replica does with what its active sends: runs
  checked and queued per vbucket, a mutation's frame body taken as its item's body.
* replica flush: the flushers writing what the apply queued (non-durable LMDB: CPU, not the
  drive).
* peer, decode only: ``decode_batch`` of the same buffers, all a DCP consumer does per item
  before its application sees the change (the catch-up goal of issue 11 compares a replica
  with such a consumer).
* replica apply, durable writes: the same feed given what a majority write sends a replica,
  per vbucket windows of 64 DCP_PREPAREs then their 64 DCP_COMMITs (taken as runs of a kind,
  ``VBucket.queue_replicated_prepares`` / ``replica_commit_many``), then the flush; the peer is
  ``decode_batch`` of the same buffers. CPU per durable write (its prepare and its commit).
* client SETs: ``Bucket.set_run`` of runs of 1,000 plain SETs spread over 64 vbuckets (what the
  node does with a received buffer of SETs, minus parsing and replies), then the flush.
* active, framing: what the active's DCP producer spends turning checkpoint runs into frames
  (``ItemFramer.items``, producer/item_encoding.py): runs of 1,000 plain mutations (any stream),
  and a replica stream's durable writes (windows of 64 prepares then their 64 commits, framed
  as DCP_PREPARE / DCP_COMMIT), CPU per item and per durable write.

Command: ``.venv/bin/python bench/bench_apply.py`` (``--items``, ``--repeat``, ``--quick``;
``--replica-only``: the plain replica rows; ``--client-only``: the client SET rows, then the
same SETs again, whose flush replaces every stored version);
docs/benchmarks.md has results. The end-to-end rows with peers in the same run are
bench_cluster.py (catch-up) and bench_node.py (ingest against Redis).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from changefeed.checkpoint import Item, SyncItem
from changefeed.checkpoint.item import CommitItem
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp_items import (
    Commit,
    Mutation,
    Prepare,
    encode_commit,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.set_run import SetRun
from changefeed.protocol.snapshot_marker import (
    MarkerFlag,
    SnapshotMarker,
    encode_snapshot_marker,
)
from changefeed.server.bucket import Bucket
from changefeed.server.node import tune_interpreter
from changefeed.storage import Op
from changefeed.vbmap import NodeAddress
from changefeed.vbucket_state import VBucketState
from support.buckets import ManualClock, open_bucket

REPLICA_VBUCKETS = 16
CLIENT_VBUCKETS = 64
SET_RUN_ITEMS = 1000
VALUE = b"x" * 100
SYNC_WINDOW = 64  # a window of 4,096 durable writes over 64 vbuckets: ~64 per vbucket


@contextmanager
def fresh_bucket(vbuckets: int) -> Iterator[Bucket]:
    with (
        tempfile.TemporaryDirectory(prefix="bench-apply-") as directory,
        open_bucket(Path(directory), ManualClock(), vbuckets=vbuckets, seed=3) as bucket,
    ):
        yield bucket


def replica_buffers(items: int) -> list[bytes]:
    per = items // REPLICA_VBUCKETS
    buffers = []
    for vb in range(REPLICA_VBUCKETS):
        frames = [encode_snapshot_marker(SnapshotMarker(vb, 1, 1, per, MarkerFlag.MEMORY))]
        frames += [
            encode_mutation(Mutation(vb, 1, seqno, b"key-%d-%d" % (vb, seqno), VALUE, 1000 + seqno))
            for seqno in range(1, per + 1)
        ]
        buffers.append(b"".join(frames))
    return buffers


def durable_buffers(writes: int) -> list[bytes]:
    """Per vbucket, a marker then windows of SYNC_WINDOW prepares followed by their commits."""
    per = writes // REPLICA_VBUCKETS
    buffers = []
    for vb in range(REPLICA_VBUCKETS):
        frames = [encode_snapshot_marker(SnapshotMarker(vb, 1, 1, 2 * per, MarkerFlag.MEMORY))]
        seqno = 0
        for first in range(0, per, SYNC_WINDOW):
            keys = [b"key-%d-%d" % (vb, n) for n in range(first, min(per, first + SYNC_WINDOW))]
            prepared = []
            for key in keys:
                seqno += 1
                prepared.append(seqno)
                prepare = Prepare(vb, 1, seqno, key, VALUE, 1000 + seqno, 1, 0, 0, False, 1)
                frames.append(encode_prepare(prepare))
            for key, at in zip(keys, prepared, strict=True):
                seqno += 1
                frames.append(encode_commit(Commit(vb, 1, key, at, seqno)))
        buffers.append(b"".join(frames))
    return buffers


def durable_run(buffers: list[bytes], writes: int) -> tuple[float, float, float]:
    decode = timed(lambda: [decode_batch(buffer) for buffer in buffers])
    batches = [decode_batch(buffer) for buffer in buffers]
    with fresh_bucket(REPLICA_VBUCKETS) as bucket:
        for vb in range(REPLICA_VBUCKETS):
            bucket.vbucket(vb).set_state(VBucketState.REPLICA)
        source = NodeAddress("active", "127.0.0.1", 1)
        feed = ReplicaFeed(bucket, source, set(range(REPLICA_VBUCKETS)), FeedOptions("me"))
        apply = timed(lambda: [feed._on_push(batch) for batch in batches])
        assert feed._failure is None, feed._failure
        flush = timed(lambda: [vbucket.flush() for vbucket in bucket.vbuckets.values()])
        held = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        assert held == 2 * writes, (held, writes)
        assert not any(vbucket.pending_prepares for vbucket in bucket.vbuckets.values())
    return decode, apply, flush


def timed(step: Callable[[], object]) -> float:
    started = time.process_time()
    step()
    return time.process_time() - started


def replica_run(buffers: list[bytes], items: int) -> tuple[float, float, float]:
    decode = timed(lambda: [decode_batch(buffer) for buffer in buffers])
    batches = [decode_batch(buffer) for buffer in buffers]
    with fresh_bucket(REPLICA_VBUCKETS) as bucket:
        for vb in range(REPLICA_VBUCKETS):
            bucket.vbucket(vb).set_state(VBucketState.REPLICA)
        source = NodeAddress("active", "127.0.0.1", 1)
        feed = ReplicaFeed(bucket, source, set(range(REPLICA_VBUCKETS)), FeedOptions("me"))
        apply = timed(lambda: [feed._on_push(batch) for batch in batches])
        assert feed._failure is None, feed._failure
        flush = timed(lambda: [vbucket.flush() for vbucket in bucket.vbuckets.values()])
        held = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        assert held == items, (held, items)
    return decode, apply, flush


def set_runs(items: int) -> list[SetRun]:
    runs = []
    for first in range(0, items, SET_RUN_ITEMS):
        run = SetRun()
        for i in range(first, min(items, first + SET_RUN_ITEMS)):
            run.vbuckets.append(i % CLIENT_VBUCKETS)
            run.opaques.append(i)
            run.keys.append(b"key-%08d" % i)
            run.values.append(VALUE)
            run.flags.append(0)
            run.expiries.append(0)
            run.datatypes.append(0)
        runs.append(run)
    return runs


def client_run(runs: list[SetRun], items: int) -> tuple[float, float]:
    return client_runs(runs, items)[:2]


def client_runs(runs: list[SetRun], items: int) -> tuple[float, float, float, float]:
    """`client_run`, then the same SETs again (every key overwritten: its stored version is
    replaced at the flush): apply and flush of new keys, apply and flush of overwrites."""
    with fresh_bucket(CLIENT_VBUCKETS) as bucket:
        apply = timed(lambda: [bucket.set_run(run) for run in runs])
        flush = timed(lambda: [vbucket.flush() for vbucket in bucket.vbuckets.values()])
        held = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        assert held == items, (held, items)
        again = timed(lambda: [bucket.set_run(run) for run in runs])
        reflush = timed(lambda: [vbucket.flush() for vbucket in bucket.vbuckets.values()])
        held = sum(vbucket.high_seqno for vbucket in bucket.vbuckets.values())
        assert held == 2 * items, (held, items)
        assert sum(bucket.store.item_count(vb) for vb in bucket.vbuckets) == items
    return apply, flush, again, reflush


FRAMED_RUN = 1000


def framing_runs(items: int) -> tuple[list[list[Item]], list[list[Item]]]:
    """Runs of plain mutations, and durable windows (prepares then their commits)."""
    plain = [
        [Item(s, b"key-%d" % s, Op.MUTATION, VALUE, 1000 + s) for s in range(f, f + FRAMED_RUN)]
        for f in range(1, items + 1, FRAMED_RUN)
    ]
    durable: list[list[Item]] = []
    seqno = 0
    for first in range(0, items // 2, SYNC_WINDOW):
        prepares = []
        for n in range(first, first + SYNC_WINDOW):
            seqno += 1
            prepares.append(
                SyncItem(seqno, b"key-%d" % n, Op.PREPARE, Op.MUTATION, VALUE, 1000 + seqno,
                         level=1)
            )  # fmt: skip
        commits = []
        for prepare in prepares:
            seqno += 1
            commits.append(prepare.committed(seqno))
        durable += [prepares, commits]  # two checkpoint runs: a commit closes the prepare's
    return plain, durable


def framing_run(plain: list[list[Item]], durable: list[list[Item]]) -> tuple[float, float]:
    def frame(runs: list[list[Item]], options: ItemOptions) -> None:
        framer = ItemFramer(3, 7, options)
        for run in runs:
            framed, count, _ = framer.items(run, 1 << 30)
            assert count == len(run), (count, len(run))
            if type(run[0]) is CommitItem:  # the replica holds the prepares: DCP_COMMITs
                assert framed[1] == Opcode.DCP_COMMIT, framed[:24]

    options = ItemOptions(delete_times=True)
    return (
        timed(lambda: frame(plain, options)),
        timed(lambda: frame(durable, ItemOptions(delete_times=True, sync_writes=True))),
    )


def best_per_item(run: Callable[[], Sequence[float]], repeat: int, items: int) -> list[float]:
    """The best of `repeat` runs of `run` (CPU seconds per row), in µs per item, per row."""
    rows = zip(*(run() for _ in range(repeat)), strict=True)
    return [min(row) * 1e6 / items for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="20,000 items, best of 2")
    parser.add_argument(
        "--replica-only", action="store_true", help="only the plain replica rows (and the peer)"
    )
    parser.add_argument(
        "--client-only", action="store_true", help="only the client SET rows, then overwrites"
    )
    args = parser.parse_args()
    if args.quick:
        args.items, args.repeat = 20_000, 2
    items = args.items - args.items % REPLICA_VBUCKETS
    tune_interpreter()
    if args.replica_only:
        buffers = replica_buffers(items)
        best = best_per_item(lambda: replica_run(buffers, items), args.repeat, items)
        print(f"{items:,} items, best of {args.repeat}, CPU us per item: peer decode "
              f"{best[0]:.2f}, replica apply {best[1]:.2f}, flush {best[2]:.2f}, apply + flush "
              f"{best[1] + best[2]:.2f} ({(best[1] + best[2]) / best[0]:.1f}x the peer), "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        return
    if args.client_only:
        runs = set_runs(items)
        best = best_per_item(lambda: client_runs(runs, items), args.repeat, items)
        print(f"{items:,} SETs, best of {args.repeat}, CPU us per item: set_run {best[0]:.2f}, "
              f"flush {best[1]:.2f}; overwrites: set_run {best[2]:.2f}, flush {best[3]:.2f}, "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        return
    buffers, runs = replica_buffers(items), set_runs(items)
    replica = [replica_run(buffers, items) for _ in range(args.repeat)]
    client = [client_run(runs, items) for _ in range(args.repeat)]
    writes = items // 2 - (items // 2) % REPLICA_VBUCKETS
    durable = durable_buffers(writes)
    sync = [durable_run(durable, writes) for _ in range(args.repeat)]
    plain_runs, sync_runs = framing_runs(items)
    framing = [framing_run(plain_runs, sync_runs) for _ in range(args.repeat)]
    plain_framed = sum(map(len, plain_runs))
    sync_framed = sum(map(len, sync_runs)) // 2
    framing_best = [
        min(column) * 1e6 / count
        for column, count in zip(
            zip(*framing, strict=True), (plain_framed, sync_framed), strict=True
        )
    ]
    columns = [*zip(*replica, strict=True), *zip(*client, strict=True)]
    sync_best = [min(column) * 1e6 / writes for column in zip(*sync, strict=True)]
    best = [min(column) * 1e6 / items for column in columns]
    rows = [
        ("peer: decode only (a DCP consumer)", best[0]),
        ("replica apply (runs per vbucket)", best[1]),
        ("replica flush", best[2]),
        ("client SETs: Bucket.set_run", best[3]),
        ("client SETs: flush", best[4]),
    ]
    print(f"{items:,} items of {len(VALUE)} bytes, best of {args.repeat}, CPU us per item")
    for label, value in rows:
        print(f"  {label:40s} {value:6.2f}")
    replica_total = best[1] + best[2]
    print(f"  replica apply + flush: {replica_total:.2f} us, {replica_total / best[0]:.1f}x "
          "the decode-only peer")  # fmt: skip
    print(f"{writes:,} durable writes (a prepare and a commit each), CPU us per write")
    print(f"  {'peer: decode only (a DCP consumer)':40s} {sync_best[0]:6.2f}")
    print(f"  {'replica apply (prepare / commit runs)':40s} {sync_best[1]:6.2f}")
    print(f"  {'replica flush':40s} {sync_best[2]:6.2f}")
    print("active, framing for a DCP stream (ItemFramer.items), CPU us")
    print(f"  {'plain mutations, per item':40s} {framing_best[0]:6.2f}")
    print(f"  {'replica stream, per durable write':40s} {framing_best[1]:6.2f}")
    print(f"  load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
