"""Runs queued as columns (`CheckpointManager.queue_columns`, items built only when read)
against the same runs queued as items built by `Item`'s constructor (`queue_run`), twin
against twin.

Two managers, two flushers and two real LMDB stores get the same history: runs of
replicated mutations (new keys, repeated keys, keys already in the open checkpoint, every
metadata field varied), single writes that deduplicate a lazy item, flush batches, collapse,
checkpoint closes, and stream readers registered, advanced and closed. After every step the
twins agree on: what `queue_*` answered (or refused: memory runs out), every event each
reader got (items compared field by field, snapshot markers with every field), `find` and
`find_many`, the checkpoints' memory and snapshot fields and every manager invariant; after
a flush, every stored record (cas, rev seqno, flags, expiry, datatype, body), the item count
and the vbucket's metadata. Readers read event by event (`next`) and in runs (`read_runs`).
Prepares and commits come between runs, as on a replica: a prepare is pending until its
commit or a plain write of its key, and the checkpoints from the oldest pending one are kept
(`retain_from`, after every such step).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from changefeed.checkpoint import (
    CAUGHT_UP,
    Checkpoint,
    CheckpointManager,
    CheckpointMemoryFullError,
    CursorKind,
    Flusher,
    Item,
    MemoryBudget,
    SnapshotStart,
    StreamReader,
    SyncItem,
    item_size_bytes,
)
from changefeed.checkpoint.backfill import StoredRun
from changefeed.storage import Op, Store

from .helpers import VB, open_store
from .replicated import columns_of

ONE = item_size_bytes(Item(1, b"k0", Op.MUTATION, b"x" * 20, 1))

# (key number, value length, flags, expiry, datatype, rev seqno) per mutation
mutations = st.tuples(
    st.integers(0, 30),
    st.integers(0, 40),
    st.sampled_from((0, 1, 0xFFFF_FFFF)),
    st.sampled_from((0, 7, 0xFFFF_FFFF)),
    st.integers(0, 7),
    st.sampled_from((1, 2, 2**40)),
)


class Twin:
    """One side: a manager, its flusher and its store."""

    def __init__(self, directory: Path, quota_bytes: int) -> None:
        self.store: Store = open_store(directory)
        self.budget = MemoryBudget(quota_bytes)
        self.manager = CheckpointManager(
            VB,
            budget=self.budget,
            checkpoint_max_bytes=6 * ONE,
            replica_cursors_droppable=True,
            columns_min_items=1,
        )
        self.flusher = Flusher(self.manager, self.store, batch_bytes_max=7 * ONE)
        self.readers: dict[str, StreamReader] = {}

    def queue(self, call: object) -> int | str:
        try:
            return call()  # type: ignore[operator, no-any-return]
        except CheckpointMemoryFullError:
            return "refused"


class ColumnRunsMachine(RuleBasedStateMachine):
    readers = Bundle("readers")

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="column-runs-"))
        self.quota = 30 * ONE
        self.columns = Twin(self.directory / "columns", self.quota)
        self.items = Twin(self.directory / "items", self.quota)
        self.high = 0
        self.next_reader = 0
        self.pending: dict[bytes, SyncItem] = {}  # key -> its prepare not committed yet

    def teardown(self) -> None:
        for twin in (self.columns, self.items):
            for reader in twin.readers.values():
                reader.close()
            twin.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def twins(self) -> tuple[Twin, Twin]:
        return self.columns, self.items

    # -- writers --------------------------------------------------------------------------------

    @rule(
        spec=st.lists(mutations, min_size=1, max_size=25),
        fresh=st.booleans(),
    )
    def queue_run(self, spec: list[tuple[int, int, int, int, int, int]], fresh: bool) -> None:
        """A replicated run; with `fresh`, keys never used before (the lazy path), else keys
        that repeat in the run and across runs (the item-by-item path)."""
        built = []
        for seqno, (key_no, size, flags, expiry, datatype, rev) in enumerate(spec, self.high + 1):
            key = b"fresh-%d" % seqno if fresh else b"key-%d" % key_no
            value = bytes([97 + key_no % 26]) * size
            built.append(
                Item(seqno, key, Op.MUTATION, value, 10_000 + 3 * seqno, flags, expiry,
                     datatype, rev)
            )  # fmt: skip
        run = columns_of(built)
        as_columns = self.columns.queue(lambda: self.columns.manager.queue_columns(run))
        as_items = self.items.queue(lambda: self.items.manager.queue_run(built))
        assert as_columns == as_items
        if as_columns != "refused":
            assert isinstance(as_columns, int)
            self.high = built[as_columns - 1].seqno
            self.end_pending([one.key for one in built[:as_columns]])

    @rule(key_no=st.integers(0, 30), fresh_of=st.integers(0, 200), delete=st.booleans())
    def queue_one(self, key_no: int, fresh_of: int, delete: bool) -> None:
        """One write of a key a run may hold lazily: deduplicates it (builds the run's items)."""
        seqno = self.high + 1
        key = b"fresh-%d" % fresh_of if fresh_of <= self.high and key_no % 2 else b"key-%d" % key_no
        op = Op.DELETION if delete else Op.MUTATION
        answers = [
            twin.queue(
                lambda twin=twin: twin.manager.queue(
                    Item(seqno, key, op, b"" if delete else b"one", 77 + seqno, delete_time=seqno)
                )
            )
            for twin in self.twins
        ]
        assert answers[0] == answers[1]
        if answers[0] != "refused":
            self.high = seqno
            self.end_pending([key])

    @rule(key_no=st.integers(0, 30), size=st.integers(0, 30))
    def queue_prepare(self, key_no: int, size: int) -> None:
        """A replicated prepare (a key a run repeats): pending until committed or written."""
        seqno = self.high + 1
        key = b"key-%d" % key_no
        prepare = SyncItem(seqno, key, Op.PREPARE, Op.MUTATION, b"p" * size, 5 + seqno, 3, 0, 1,
                           2, level=1)  # fmt: skip
        answers = [
            twin.queue(lambda twin=twin: twin.manager.queue_prepares([prepare]))
            for twin in self.twins
        ]
        assert answers[0] == answers[1]
        if answers[0] != "refused":
            self.high = seqno
            self.pending[key] = prepare
            self.retain()

    @rule(pick=st.integers(0, 1000))
    def commit(self, pick: int) -> None:
        """The commit of a pending prepare."""
        if not self.pending:
            return
        key = sorted(self.pending)[pick % len(self.pending)]
        commit = self.pending[key].committed(self.high + 1)
        answers = [
            twin.queue(lambda twin=twin: twin.manager.queue_run([commit], commits=True))
            for twin in self.twins
        ]
        assert answers[0] == answers[1]
        if answers[0] != "refused":
            self.high = commit.seqno
            self.end_pending([key])

    def end_pending(self, keys: list[bytes]) -> None:
        """A commit or plain write of these keys ends their prepares (as the replica role)."""
        if not self.pending.keys().isdisjoint(keys):
            for key in keys:
                self.pending.pop(key, None)
            self.retain()

    def retain(self) -> None:
        first = min((prepare.seqno for prepare in self.pending.values()), default=None)
        for twin in self.twins:
            twin.manager.retain_from(first)

    @rule()
    def flush_one_batch(self) -> None:
        assert self.columns.flusher.flush_batch() == self.items.flusher.flush_batch()
        self.stores_agree()

    @rule()
    def flush(self) -> None:
        assert self.columns.flusher.flush() == self.items.flusher.flush()
        self.stores_agree()
        assert self.columns.flusher.persisted_seqno == self.high

    @rule()
    def close_open_checkpoint(self) -> None:
        for twin in self.twins:
            twin.manager.close_open_checkpoint()

    @rule()
    def collapse(self) -> None:
        for twin in self.twins:
            twin.manager.collapse()

    @rule(key_no=st.integers(0, 30), fresh_of=st.integers(0, 200))
    def find(self, key_no: int, fresh_of: int) -> None:
        keys = [b"key-%d" % key_no, b"fresh-%d" % fresh_of]
        if fresh_of % 2:  # find_many first: find settles the checkpoints it looks in
            more = [*keys, b"fresh-%d" % (fresh_of + 1), b"key-%d" % (key_no ^ 1)]
            assert self.columns.manager.find_many(more) == self.items.manager.find_many(more)
        for key in keys:
            assert self.columns.manager.find(key) == self.items.manager.find(key)

    # -- readers --------------------------------------------------------------------------------

    @rule(target=readers, fraction=st.floats(0, 1))
    def register(self, fraction: float) -> str:
        start = int(self.high * fraction)
        name = f"reader{self.next_reader}"
        self.next_reader += 1
        for twin in self.twins:
            twin.readers[name] = StreamReader(
                twin.manager, twin.store, name=name, start_seqno=start, kind=CursorKind.STREAM
            )
        return name

    @rule(name=readers, count=st.integers(1, 30))
    def advance(self, name: str, count: int) -> None:
        if name not in self.columns.readers:
            return
        for _ in range(count):
            got = [twin.readers[name].next() for twin in self.twins]
            assert comparable(got[0]) == comparable(got[1])
            if got[0] is CAUGHT_UP:
                break

    @rule(name=readers, events_max=st.integers(1, 30), bytes_max=st.integers(1, 8 * ONE))
    def read_runs(self, name: str, events_max: int, bytes_max: int) -> None:
        """A stream's read in runs (`next_run` with no byte bound over lazy slots)."""
        if name not in self.columns.readers:
            return
        got = [
            list(map(comparable, twin.readers[name].read_runs(events_max, bytes_max)))
            for twin in self.twins
        ]
        assert got[0] == got[1]

    @rule(name=consumes(readers))
    def close_reader(self, name: str) -> None:
        for twin in self.twins:
            reader = twin.readers.pop(name, None)
            if reader is not None:
                reader.close()

    # -- after every step -----------------------------------------------------------------------

    @invariant()
    def twins_agree(self) -> None:
        for twin in self.twins:
            twin.manager._check_invariants()
        assert self.columns.manager.memory_bytes == self.items.manager.memory_bytes
        assert self.columns.budget.used_bytes == self.items.budget.used_bytes
        assert self.columns.manager.high_seqno == self.items.manager.high_seqno == self.high
        assert list(map(snapshot_of, self.columns.manager.checkpoints())) == list(
            map(snapshot_of, self.items.manager.checkpoints())
        )

    def stores_agree(self) -> None:
        stores = [twin.store for twin in self.twins]
        high = stores[0].high_seqno(VB)
        assert high == stores[1].high_seqno(VB)
        assert list(stores[0].scan(VB, 0, high)) == list(stores[1].scan(VB, 0, high))
        assert stores[0].item_count(VB) == stores[1].item_count(VB)
        assert stores[0].vbucket_meta(VB) == stores[1].vbucket_meta(VB)
        assert stores[0].prepares(VB) == stores[1].prepares(VB)
        assert self.columns.flusher.kept_prepares == self.items.flusher.kept_prepares


def comparable(got: object) -> object:
    """What a reader handed out, with every field (SnapshotStart's == ignores the V2.0 ones)."""
    if isinstance(got, SnapshotStart):
        return dataclasses.astuple(got)
    if isinstance(got, StoredRun):
        return ("stored", got.records)
    return got


def snapshot_of(checkpoint: Checkpoint) -> tuple[int, int, int, int, int]:
    """What a checkpoint's snapshot marker is made of."""
    return (
        checkpoint.snap_start,
        checkpoint.snap_end,
        checkpoint.visible_end,
        checkpoint.high_completed,
        checkpoint.marker_end,
    )


ColumnRunsMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True
)
TestColumnRuns = ColumnRunsMachine.TestCase


def test_a_flush_batch_of_lazy_items_ends_at_the_one_reaching_its_bytes() -> None:
    """Equal items, a batch bound of exactly three: three per batch (`next_run`'s rule)."""
    directory = Path(tempfile.mkdtemp(prefix="column-runs-"))
    try:
        store = open_store(directory)
        manager = CheckpointManager(
            VB, budget=MemoryBudget(10**9), checkpoint_max_bytes=10**9, columns_min_items=1
        )
        built = [Item(s, b"k%03d" % s, Op.MUTATION, b"v" * 9, 5 + s) for s in range(1, 11)]
        run = columns_of(built)  # flags, expiry and datatype 0, rev seqno 1
        assert manager.queue_columns(run) == 10
        assert manager.open_checkpoint.lazy  # queued with no item built
        size = item_size_bytes(built[0])
        flusher = Flusher(manager, store, batch_bytes_max=3 * size)
        assert [flusher.flush_batch() for _ in range(5)] == [3, 3, 3, 1, 0]
        assert manager.open_checkpoint.lazy  # written with no item built either
        assert [record.key for record in store.scan(VB, 0, 10)] == [one.key for one in built]
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_lazy_run_ends_a_kept_prepare_of_its_key_as_items_do() -> None:
    """A prepare persisted and kept, then a run of columns holding its key (taken lazily:
    the prepare is in the other namespace): the flush ends the kept prepare, as it does
    after a run of items."""
    directory = Path(tempfile.mkdtemp(prefix="column-runs-"))
    try:
        twins = [Twin(directory / name, 10**9) for name in ("columns", "items")]
        prepare = SyncItem(1, b"k2", Op.PREPARE, Op.MUTATION, b"p", 50, level=1)
        built = [Item(s, b"k%d" % s, Op.MUTATION, b"v" * s, 5 + s, s, s, s % 8, s)
                 for s in range(2, 12)]  # fmt: skip
        run = columns_of(built)
        for twin in twins:
            twin.manager.queue_prepares([prepare])
            assert twin.flusher.flush() == 1
            assert twin.flusher.kept_prepares == {b"k2"}
        assert twins[0].manager.queue_columns(run) == twins[1].manager.queue_run(built) == 10
        assert twins[0].manager.open_checkpoint.lazy  # the run went in as columns
        for twin in twins:
            assert twin.flusher.flush() == 10
            assert twin.flusher.kept_prepares == set()
            assert twin.store.prepares(VB) == []
        stores = [twin.store for twin in twins]
        assert list(stores[0].scan(VB, 0, 11)) == list(stores[1].scan(VB, 0, 11))
        for twin in twins:
            twin.store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_lazy_batch_whose_commit_fails_is_written_again_whole() -> None:
    """A flush round holding column slices is aborted (the commit failed): the persistence
    cursor goes back, the run is still unbuilt, and the next flush writes every item."""
    directory = Path(tempfile.mkdtemp(prefix="column-runs-"))
    try:
        store = open_store(directory)
        manager = CheckpointManager(
            VB, budget=MemoryBudget(10**9), checkpoint_max_bytes=10**9, columns_min_items=1
        )
        built = [Item(s, b"k%03d" % s, Op.MUTATION, b"v" * s, 5 + s) for s in range(1, 21)]
        run = columns_of(built)  # flags, expiry and datatype 0, rev seqno 1
        assert manager.queue_columns(run) == 20
        flusher = Flusher(manager, store)
        batch = store.begin_batch()
        staged = flusher.stage(batch)
        assert staged is not None and staged.count == 20
        store.abort_batch(batch)
        flusher.staged_failed(staged)
        assert store.high_seqno(VB) == 0 and flusher.persisted_seqno == 0
        assert manager.open_checkpoint.lazy  # still not built
        assert flusher.flush() == 20
        assert [(r.seqno, r.key, r.value, r.cas) for r in store.scan(VB, 0, 20)] == [
            (one.seqno, one.key, one.value, one.cas) for one in built
        ]
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
