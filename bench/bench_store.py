"""Storage benchmark: batch writes and backfill scans, items per second, against SQLite.

Workloads (values 100 bytes, keys 14 bytes, items spread round-robin over 16 vbuckets):

* write, batches of 1,000 and of 10,000 items, into a fresh store: ``WriteBatch.set`` per
  item, one commit per batch (group commit). Durability as the peer's: ``durable=False``
  (survives kill -9, not power loss) against SQLite WAL + ``synchronous=NORMAL``, and
  ``durable=True`` (fsync per commit) against WAL + ``synchronous=FULL``;
* backfill scan: ``Store.scan`` of every vbucket over the whole store (``--items`` records),
  producing ``Record`` objects.

The peer is SQLite (stdlib ``sqlite3``) doing the same work with the same bytes: one table
``(vb, seqno) -> record`` WITHOUT ROWID plus a unique index on ``(vb, key)`` so that a key keeps
one version (``INSERT OR REPLACE`` drops the older row), a per-vbucket metadata row upserted per
batch, and each item encoded to the same stored record bytes with one ``struct.pack`` (the
cheapest per-item encoding; our ``set`` also checks its arguments). The peer's scan selects by
the ``(vb, seqno)`` primary key in seqno order and decodes each row with the same
``decode_record``, so both scans end with identical ``Record`` lists. Ratios are ours / peer's.

Usage::

    .venv/bin/python bench/bench_store.py              # 1,000,000 items
    .venv/bin/python bench/bench_store.py --quick      # 50,000 items, for a smoke run
    .venv/bin/python bench/bench_store.py --items 200000 --repeat 5

Each measurement runs ``--repeat`` times on a fresh store and the best is reported (least
disturbed by the rest of the machine), with the cyclic GC off while timing. Every run checks
what it wrote or read, so a fast wrong path cannot win.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

from changefeed.storage import Store
from changefeed.storage.record import MUTATION_HEAD, TAG_MUTATION, Record, decode_record

VBUCKETS = 16
VALUE_BYTES = 100
SEQNO_ALL = 2**64 - 1
SMALL_BATCH_ITEMS_MAX = 200_000  # items written in 1k batches (the 10k run writes --items)
DURABLE_ITEMS_MAX = 20_000  # fsync per commit: 20 batches of 1k keep the run short


@dataclass(frozen=True)
class Items:
    """The items of a run: item i goes to vb i % VBUCKETS with seqno i // VBUCKETS + 1."""

    keys: list[bytes]
    value: bytes

    def batches(self, count: int, batch_items: int) -> Iterator[range]:
        for start in range(0, count, batch_items):
            yield range(start, min(start + batch_items, count))


# --- changefeed --------------------------------------------------------------------------------


def ours_write(path: Path, items: Items, count: int, batch_items: int, durable: bool) -> float:
    """Seconds to write `count` items in batches; the store is left at `path`."""
    keys, value = items.keys, items.value
    with Store(path, durable=durable) as store:
        with store.write_batch() as batch:
            for vb in range(VBUCKETS):
                batch.set_vbucket_meta(vb, state="active", failover_log=[(vb + 1, 0)])
        started = time.perf_counter()
        for indices in items.batches(count, batch_items):
            with store.write_batch() as batch:
                for i in indices:
                    batch.set(i % VBUCKETS, keys[i], i // VBUCKETS + 1, value, cas=i)
        elapsed = time.perf_counter() - started
        assert sum(store.item_count(vb) for vb in range(VBUCKETS)) == count
    return elapsed


def ours_scan(path: Path) -> tuple[float, list[Record]]:
    with Store(path, durable=False) as store:
        started = time.perf_counter()
        records = [record for vb in range(VBUCKETS) for record in store.scan(vb, 0, SEQNO_ALL)]
        return time.perf_counter() - started, records


# --- SQLite peer -------------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE items (vb INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL,
                    rec BLOB NOT NULL, PRIMARY KEY (vb, seqno)) WITHOUT ROWID;
CREATE UNIQUE INDEX items_by_key ON items (vb, key);
CREATE TABLE vbmeta (vb INTEGER PRIMARY KEY, meta BLOB NOT NULL);
"""


def peer_connect(path: Path, durable: bool) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    return connection


def peer_write(path: Path, items: Items, count: int, batch_items: int, durable: bool) -> float:
    keys, value = items.keys, items.value
    pack = MUTATION_HEAD.pack
    connection = peer_connect(path, durable)
    connection.executescript(SCHEMA)
    insert = "INSERT OR REPLACE INTO items VALUES (?, ?, ?, ?)"
    upsert = "INSERT INTO vbmeta VALUES (?, ?) ON CONFLICT (vb) DO UPDATE SET meta = excluded.meta"
    started = time.perf_counter()
    for indices in items.batches(count, batch_items):
        rows = []
        for i in indices:
            vb, seqno, key = i % VBUCKETS, i // VBUCKETS + 1, keys[i]
            stored = pack(TAG_MUTATION, 0, len(key), i, seqno, 1, 0, 0, 0, 0, 0) + key + value
            rows.append((vb, seqno, key, stored))
        connection.execute("BEGIN")
        connection.executemany(insert, rows)
        high = {row[0]: row[1] for row in rows}
        connection.executemany(upsert, [(vb, b"%d" % seqno) for vb, seqno in high.items()])
        connection.execute("COMMIT")
    elapsed = time.perf_counter() - started
    assert connection.execute("SELECT count(*) FROM items").fetchone()[0] == count
    connection.close()
    return elapsed


def peer_scan(path: Path) -> tuple[float, list[Record]]:
    connection = peer_connect(path, durable=False)
    query = "SELECT seqno, rec FROM items WHERE vb = ? AND seqno BETWEEN ? AND ? ORDER BY seqno"
    started = time.perf_counter()
    records = [
        decode_record(vb, seqno, stored)
        for vb in range(VBUCKETS)
        for seqno, stored in connection.execute(query, (vb, 0, 2**63 - 1))
    ]
    elapsed = time.perf_counter() - started
    connection.close()
    return elapsed, records


# --- harness -----------------------------------------------------------------------------------


def best_of(repeat: int, run: Callable[[], float]) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            times.append(run())
        finally:
            gc.enable()
    return min(times)


def fresh(directory: Path, name: str) -> Path:
    path = directory / name
    shutil.rmtree(path, ignore_errors=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


def write_row(
    directory: Path, items: Items, count: int, batch_items: int, durable: bool, repeat: int
) -> tuple[float, float]:
    """(our items/s, peer items/s) writing `count` items; leaves both stores written."""

    def ours() -> float:
        return ours_write(fresh(directory, "lmdb"), items, count, batch_items, durable)

    def peer() -> float:
        return peer_write(fresh(directory, "sqlite.db"), items, count, batch_items, durable)

    return count / best_of(repeat, ours), count / best_of(repeat, peer)


def scan_row(directory: Path, count: int, repeat: int) -> tuple[float, float]:
    """(our items/s, peer items/s) scanning the stores the last write_row left."""
    results: dict[str, list[Record]] = {}

    def timed(name: str, scan: Callable[[Path], tuple[float, list[Record]]]) -> float:
        elapsed, records = scan(directory / name)
        assert len(records) == count, (name, len(records), count)
        results[name] = records
        return elapsed

    ours = count / best_of(repeat, lambda: timed("lmdb", ours_scan))
    peer = count / best_of(repeat, lambda: timed("sqlite.db", peer_scan))
    assert results["lmdb"] == results["sqlite.db"]  # the same Records, in the same order
    return ours, peer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="items in the scanned store")
    parser.add_argument("--quick", action="store_true", help="50,000 items, for a smoke run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; best kept")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the stores")
    arguments = parser.parse_args()
    count = 50_000 if arguments.quick else arguments.items
    items = Items([b"key-%010d" % i for i in range(count)], os.urandom(VALUE_BYTES))
    small = min(count, SMALL_BATCH_ITEMS_MAX)
    durable_count = min(count, DURABLE_ITEMS_MAX)
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory(dir=arguments.dir) as name:
        directory = Path(name)
        repeat = arguments.repeat
        write = write_row(directory, items, small, 1_000, False, repeat)
        rows.append((f"write {small:,} in batches of 1k, kill-9 safe", *write))
        write = write_row(directory, items, durable_count, 1_000, True, repeat)
        rows.append((f"write {durable_count:,} in batches of 1k, fsync", *write))
        write = write_row(directory, items, count, 10_000, False, repeat)
        rows.append((f"write {count:,} in batches of 10k, kill-9 safe", *write))
        rows.append((f"backfill scan of {count:,} -> Record", *scan_row(directory, count, repeat)))
    print_table(count, repeat, rows)


def print_table(count: int, repeat: int, rows: list[tuple[str, float, float]]) -> None:
    print(
        f"storage benchmark: {count:,} items, key 14 B, value {VALUE_BYTES} B, {VBUCKETS} "
        f"vbuckets, best of {repeat}, cyclic GC off while timing"
    )
    print(
        f"Python {platform.python_version()} ({platform.machine()}), py-lmdb {lmdb.__version__} "
        f"(LMDB {'.'.join(map(str, lmdb.version()))}), SQLite {sqlite3.sqlite_version}, "
        f"{os.cpu_count()} CPUs"
    )
    print("peer: SQLite WAL, synchronous=NORMAL (kill-9 safe rows) / FULL (fsync row)")
    print()
    header = f"{'workload':<46} {'changefeed':>12} {'SQLite':>12} {'ours/peer':>10}"
    print(header)
    print("-" * len(header))
    for name, ours, peer in rows:
        print(f"{name:<46} {ours / 1e6:>10.3f}M/s {peer / 1e6:>10.3f}M/s {ours / peer:>9.2f}x")


if __name__ == "__main__":
    main()
