"""The flusher writes a batch's prepares, aborts and committed documents as stretches
(`put_prepares` for a stretch of prepares, `put_bodies` for the documents between them)
instead of one call per item: twin vbuckets get the same durable and plain writes (durable SETs
and deletes; flags, expiries, datatypes), commits and aborts, one flushed in whole batches and
the other one item per batch (so every stretch is a single item, as the per-item path wrote
them), with flushes at the same points. The store must hold the same records and kept
prepares (every field), high seqno, snapshot range and high completed seqno."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import SyncItem
from changefeed.protocol.errors import StatusError
from changefeed.storage import Op, Store, WriteBatch
from changefeed.vbucket import VBucket, VBucketState

VB = 2
NOW = 1_700_000_000.0
KEYS = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]


def make(path: Path, batch_bytes_max: int) -> tuple[VBucket, Store]:
    store = Store(path, map_size_bytes=64 * 1024 * 1024, durable=False)
    vbucket = VBucket(store, VB, state=VBucketState.ACTIVE, clock=lambda: NOW,
                      rng=random.Random(5), flush_batch_bytes_max=batch_bytes_max)  # fmt: skip
    return vbucket, store


def apply(vbucket: VBucket, op: tuple[str, int, int]) -> None:
    kind, key_index, level = op
    key = KEYS[key_index]
    try:
        if kind == "durable":
            vbucket.set(key, b"d" * key_index, flags=key_index, expiry=int(NOW) + 100 * level,
                        datatype=level & 1, level=level)  # fmt: skip
        elif kind == "durable-delete":
            vbucket.delete(key, level=level)
        elif kind == "durable-run":
            keys = [k for k in KEYS[key_index:] if vbucket.pending_prepare(k) is None]
            n = len(keys)
            vbucket.set_many(keys, [b"r"] * n, [0] * n, [0] * n, [0] * n, level=level)
        elif kind == "plain":
            vbucket.set(key, b"p" * key_index, flags=level, datatype=key_index & 1)
        elif kind == "delete":
            vbucket.delete(key)
        elif kind == "commit":
            pending = [p.key for p in vbucket.pending_prepares]
            vbucket.commit_many(pending[: key_index + 1])
        elif kind == "abort":
            vbucket.abort(key)
        elif kind == "flush":
            vbucket.flush()
    except StatusError:
        pass  # the same refusal on both twins


def state(vbucket: VBucket, store: Store) -> list[object]:
    meta = store.vbucket_meta(VB)
    assert meta is not None
    return [
        list(store.scan(VB, 0, 1 << 40)),  # records compare every field (flags, expiry...)
        store.prepares(VB),  # (level, the prepare as a record: its op, rev_seqno...)
        store.high_seqno(VB),
        (meta.snap_start, meta.snap_end),
        store.high_completed_seqno(VB),
        vbucket.persisted_seqno,
    ]


ops = st.lists(
    st.tuples(
        st.sampled_from(["durable"] * 4 + ["durable-delete"] * 2 + ["durable-run", "plain",
                         "delete", "commit", "abort", "flush", "flush"]),
        st.integers(0, len(KEYS) - 1),
        st.integers(1, 3),
    ),
    max_size=40,
)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(ops)
def test_stretches_store_what_one_item_per_batch_stores(
    tmp_path_factory: pytest.TempPathFactory, history: list[tuple[str, int, int]]
) -> None:
    whole, whole_store = make(tmp_path_factory.mktemp("whole"), 1 << 20)
    single, single_store = make(tmp_path_factory.mktemp("single"), 1)
    try:
        for op in history:
            apply(whole, op)
            apply(single, op)
        whole.flush()
        single.flush()
        assert state(whole, whole_store) == state(single, single_store)
        assert whole.flusher.kept_prepares == single.flusher.kept_prepares
    finally:
        whole_store.close()
        single_store.close()


def prepare(seqno: int, key: bytes, level: int = 1, op: Op = Op.MUTATION) -> SyncItem:
    if op is Op.DELETION:
        return SyncItem(seqno, key, Op.PREPARE, op, b"", cas=seqno + 100, rev_seqno=seqno,
                        delete_time=int(NOW), level=level)  # fmt: skip
    return SyncItem(seqno, key, Op.PREPARE, op, b"value", cas=seqno + 100, flags=seqno,
                    expiry=int(NOW) + seqno, datatype=seqno & 1, rev_seqno=seqno,
                    level=level)  # fmt: skip


@given(
    st.lists(
        st.tuples(st.sampled_from(KEYS), st.integers(0, 300), st.sampled_from([Op.MUTATION,
                                                                              Op.DELETION])),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 9),
)  # fmt: skip
def test_put_prepares_is_put_prepare_each(
    tmp_path_factory: pytest.TempPathFactory, specs: list[tuple[bytes, int, Op]], first: int
) -> None:
    """Same prepares kept and the same first error (a level over 255, a seqno not above the
    high seqno), for a stretch and for one call each."""
    items = [prepare(first + i + 1, key, level, op) for i, (key, level, op) in enumerate(specs)]
    kept: list[object] = []
    for run in (True, False):
        store = Store(tmp_path_factory.mktemp("s"), map_size_bytes=16 << 20, durable=False)
        try:
            with store.write_batch() as batch:
                batch.set_vbucket_meta(VB, state=VBucketState.ACTIVE)
            error = None
            try:
                with store.write_batch() as batch:
                    batch.set(VB, b"zz", 5, b"x", cas=1)
                    put(batch, items, run)
            except ValueError as raised:
                error = type(raised).__name__, str(raised)
            kept.append((error, store.prepares(VB), store.high_seqno(VB)))
        finally:
            store.close()
    assert kept[0] == kept[1]


def put(batch: WriteBatch, items: list[SyncItem], run: bool) -> None:
    if run:
        batch.put_prepares(VB, items)
        return
    for item in items:
        batch.put_prepare(VB, item.key, item.seqno, item.doc_op, level=item.level,
                          datatype=item.datatype, cas=item.cas, body=item.body)  # fmt: skip
