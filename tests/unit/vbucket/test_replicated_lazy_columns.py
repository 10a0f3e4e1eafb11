"""A replica's long run of new keys as columns (`VBucket.queue_replicated_columns`, at least
`COLUMNS_MIN_ITEMS`: queued lazily, no `Item` built) against the same run as items
(`queue_replicated_run`): the same copy, the pending prepare of a key in the run ended, and
the same records once flushed. Shorter runs are built and queued as items
(test_replicated_columns.py covers those)."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import given, settings

from changefeed.checkpoint import Item
from changefeed.checkpoint.manager import COLUMNS_MIN_ITEMS
from changefeed.storage import Op, Store

from .test_replicated_columns import columns_of, replica


@contextlib.contextmanager
def fresh_store() -> Iterator[Store]:
    """A store of its own per example (a flushed vbucket's records stay in its store)."""
    with tempfile.TemporaryDirectory(prefix="lazy-columns-") as directory:
        opened = Store(Path(directory), map_size_bytes=64 << 20, durable=False)
        try:
            yield opened
        finally:
            opened.close()


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    extra=st.integers(0, 20),
    with_p=st.booleans(),
    values=st.lists(st.binary(max_size=8), min_size=1, max_size=4),
)
def test_a_long_run_of_new_keys_applies_lazily_as_the_items_do(
    extra: int, with_p: bool, values: list[bytes]
) -> None:
    with fresh_store() as store:
        check_long_run(store, extra, with_p, values)


def check_long_run(store: Store, extra: int, with_p: bool, values: list[bytes]) -> None:
    count = COLUMNS_MIN_ITEMS + extra
    keys = [b"k%d" % i for i in range(count - 1)] + [b"p" if with_p else b"q"]
    items = [
        Item(2 + i, key, Op.MUTATION, values[i % len(values)], cas=100 + i, flags=i,
             datatype=i % 8, rev_seqno=1 + i)
        for i, key in enumerate(keys)
    ]  # fmt: skip
    run = columns_of(items)
    by_items, by_columns = replica(store, 0), replica(store, 1)
    for vbucket in (by_items, by_columns):
        vbucket.replica_snapshot(2, 1 + count)
    assert by_items.queue_replicated_run(items) == count
    assert by_columns.queue_replicated_columns(run) == count
    assert by_columns.manager.open_checkpoint.lazy  # queued with no Item built
    assert by_columns.high_seqno == by_items.high_seqno == 1 + count
    assert by_columns.pending_prepares == by_items.pending_prepares  # ended by a write of p
    for vbucket in (by_items, by_columns):
        vbucket.flusher.flush()
    stored = [[dataclasses.replace(record, vb=0) for record in store.scan(vb, 0, 1 + count)]
              for vb in (0, 1)]  # fmt: skip
    assert stored[1] == stored[0]
    assert len(stored[0]) == count
    for key in (*keys[:3], b"p", b"q"):
        assert by_columns.get(key) == by_items.get(key)
    for vbucket in (by_items, by_columns):
        vbucket.release()
