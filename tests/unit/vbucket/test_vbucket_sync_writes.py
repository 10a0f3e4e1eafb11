"""SyncWrites below the server: a prepare is invisible until committed, its key is held, it
survives a restart (the store keeps it) and a vbucket that is or becomes active commits it;
replicas keep and end prepares as their active sends them; application streams never see a
prepare or an abort, replica streams get DCP_PREPARE / DCP_ABORT; a checkpoint holding a
pending prepare stays in memory. A hypothesis model checks reads, restarts and flushes."""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from changefeed.checkpoint import MARKER_FLAG_DISK, Item, SnapshotStart, SyncItem
from changefeed.producer.encoder import DcpEncoder
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.protocol.dcp_items import (
    Abort,
    Commit,
    Prepare,
    decode_abort,
    decode_commit,
    decode_prepare,
    encode_abort,
    encode_commit,
    encode_prepare,
)
from changefeed.protocol.errors import (
    InvalidArgumentsError,
    KeyNotFoundError,
    ProtocolError,
    SyncWriteInProgressError,
)
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.snapshot_marker import MarkerVersion, decode_snapshot_marker
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket, VBucketState

VB = 5
MAJORITY = 1


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path, map_size_bytes=64 * 1024 * 1024, durable=False)
    yield opened
    opened.close()


def make(store: Store, state: VBucketState = VBucketState.ACTIVE) -> VBucket:
    return VBucket(store, VB, state=state, rng=random.Random(7))


def test_a_prepare_is_invisible_and_holds_its_key_until_committed(store: Store) -> None:
    vb = make(store)
    before = vb.set(b"k", b"old")
    prepared = vb.set(b"k", b"new", level=MAJORITY)
    assert prepared.seqno == before.seqno + 1
    document = vb.get(b"k")
    assert document is not None and (document.value, document.cas) == (b"old", before.cas)
    with pytest.raises(SyncWriteInProgressError):
        vb.set(b"k", b"other")
    with pytest.raises(SyncWriteInProgressError):
        vb.delete(b"k")
    vb.set(b"another", b"x")  # other keys are not held
    committed = vb.commit(b"k")
    assert committed.seqno == vb.high_seqno and committed.cas == prepared.cas
    document = vb.get(b"k")
    assert document is not None
    assert (document.value, document.cas, document.seqno) == (b"new", prepared.cas, committed.seqno)
    vb.set(b"k", b"after")  # released


def test_an_abort_leaves_the_committed_version_and_releases_the_key(store: Store) -> None:
    vb = make(store)
    before = vb.set(b"k", b"old")
    vb.delete(b"k", level=MAJORITY)
    abort_seqno = vb.abort(b"k")
    assert abort_seqno == vb.high_seqno == before.seqno + 2
    document = vb.get(b"k")
    assert document is not None and document.value == b"old"
    assert vb.abort(b"k") == 0  # nothing pending any more
    with pytest.raises(KeyNotFoundError):
        vb.commit(b"k")
    vb.flush()
    assert store.prepares(VB) == []
    assert store.high_seqno(VB) == abort_seqno


def test_a_flushed_prepare_is_kept_and_committed_when_an_active_restarts(store: Store) -> None:
    vb = make(store)
    vb.set(b"k", b"old")
    prepared = vb.set(b"k", b"new", flags=9, level=3)
    vb.flush()
    [(level, record)] = store.prepares(VB)
    assert (level, record.seqno, record.value, record.flags) == (3, prepared.seqno, b"new", 9)
    assert store.get(VB, b"k").value == b"old"  # type: ignore[union-attr]
    vb.release()

    again = make(store)  # warmup of an active vbucket
    document = again.get(b"k")
    assert document is not None
    assert (document.value, document.cas, document.flags) == (b"new", prepared.cas, 9)
    assert again.pending_prepares == []
    again.flush()
    assert store.prepares(VB) == []
    assert store.get(VB, b"k").value == b"new"  # type: ignore[union-attr]


def test_a_replica_keeps_its_prepares_across_a_restart_and_commits_on_promotion(
    store: Store,
) -> None:
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 2)
    replica.queue_replicated(Item(1, b"a", Op.MUTATION, b"one", 11))
    replica.queue_replicated(SyncItem(2, b"a", Op.PREPARE, Op.MUTATION, b"two", 12, level=MAJORITY))
    replica.flush()
    replica.release()

    again = make(store, VBucketState.REPLICA)
    assert [p.seqno for p in again.pending_prepares] == [2]
    assert again.get(b"a").value == b"one"  # type: ignore[union-attr]
    again.set_state(VBucketState.ACTIVE)  # promoted: what it holds may have been acknowledged
    document = again.get(b"a")
    assert document is not None and (document.value, document.cas) == (b"two", 12)
    assert again.pending_prepares == []


def test_a_replica_ends_a_prepare_on_an_abort_or_a_later_committed_change(store: Store) -> None:
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 4)
    replica.queue_replicated(SyncItem(1, b"a", Op.PREPARE, Op.MUTATION, b"p", 5, level=1))
    replica.queue_replicated(SyncItem(2, b"b", Op.PREPARE, Op.DELETION, b"", 6, level=1))
    replica.queue_replicated(SyncItem(3, b"a", Op.ABORT, Op.DELETION, b"", 5, prepared_seqno=1))
    replica.queue_replicated(Item(4, b"b", Op.MUTATION, b"committed", 7))
    assert replica.pending_prepares == []
    assert replica.get(b"a") is None
    assert replica.get(b"b").value == b"committed"  # type: ignore[union-attr]
    replica.flush()
    assert store.prepares(VB) == []


def test_a_replica_rollback_drops_prepares_past_the_point(store: Store) -> None:
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 3)
    replica.queue_replicated(Item(1, b"a", Op.MUTATION, b"x", 5))
    replica.queue_replicated(Item(2, b"b", Op.MUTATION, b"y", 6))
    replica.queue_replicated(SyncItem(3, b"c", Op.PREPARE, Op.MUTATION, b"z", 7, level=1))
    replica.flush()
    assert replica.rollback(2) == 2
    assert replica.pending_prepares == []
    assert store.prepares(VB) == []


def test_warmup_never_resurrects_a_prepare_over_a_newer_committed_value(store: Store) -> None:
    """A prepare whose abort was lost in a crash, then the key written again: the kept prepare
    is older than the committed value, so warmup aborts it instead of committing it."""
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 2)
    replica.queue_replicated(SyncItem(1, b"k", Op.PREPARE, Op.MUTATION, b"stale", 5, level=1))
    replica.flush()
    # The store as a crash could leave it: the newer write persisted, the prepare still kept
    # (a batch written directly, as a replica's flusher would have after the lost abort).
    newer = Item(2, b"k", Op.MUTATION, b"newer", 6)
    with store.write_batch() as batch:
        batch.put_body(VB, b"k", 2, Op.MUTATION, datatype=0, cas=6, body=newer.body)
    replica.release()
    assert len(store.prepares(VB)) == 1
    active = make(store)  # the store says REPLICA; promote as a failover would
    active.set_state(VBucketState.ACTIVE)
    # set_state commits what it holds; a kept prepare older than the key's newest committed
    # version would overwrite it: it must not.
    document = active.get(b"k")
    assert document is not None and document.value == b"newer"


def test_application_streams_skip_prepares_and_aborts_replica_streams_get_them() -> None:
    prepare = SyncItem(5, b"d", Op.PREPARE, Op.MUTATION, b"v5", 13, level=1)
    items: list[Item] = [
        Item(1, b"a", Op.MUTATION, b"v1", 10),
        SyncItem(2, b"b", Op.PREPARE, Op.MUTATION, b"v2", 11, flags=3, expiry=4, level=2),
        SyncItem(3, b"b", Op.ABORT, Op.DELETION, b"", 11, prepared_seqno=2),
        Item(4, b"c", Op.MUTATION, b"v4", 12),
        prepare,
        prepare.committed(6),
    ]
    application = ItemFramer(VB, 77, ItemOptions(delete_times=True))
    data, count, _ = application.items(items, 1 << 20)
    assert count == 6  # every item counts as framed: the stream moves past all seqnos
    assert [(f.opcode, f.key, f.cas) for f in _frames(data)] == [
        (Opcode.DCP_MUTATION, b"a", 10),
        (Opcode.DCP_MUTATION, b"c", 12),
        (Opcode.DCP_MUTATION, b"d", 13),  # the commit: the document, with the prepare's CAS
    ]
    replica = ItemFramer(VB, 77, ItemOptions(delete_times=True, sync_writes=True))
    data, count, _ = replica.items(items, 1 << 20)
    frames = _frames(data)
    assert count == 6
    assert [f.opcode for f in frames] == [
        Opcode.DCP_MUTATION,
        Opcode.DCP_PREPARE,
        Opcode.DCP_ABORT,
        Opcode.DCP_MUTATION,
        Opcode.DCP_PREPARE,
        Opcode.DCP_COMMIT,
    ]
    commit = decode_commit(frames[5])
    assert (commit.key, commit.prepared_seqno, commit.commit_seqno) == (b"d", 5, 6)
    prepare = decode_prepare(frames[1])
    assert (prepare.seqno, prepare.key, prepare.value, prepare.cas) == (2, b"b", b"v2", 11)
    assert (prepare.flags, prepare.expiry, prepare.level, prepare.deleted) == (3, 4, 2, False)
    abort = decode_abort(frames[2])
    assert (abort.key, abort.prepared_seqno, abort.abort_seqno) == (b"b", 2, 3)


def test_a_replica_stream_gets_dcp_commit_only_for_a_prepare_it_sent() -> None:
    """The chaos suite found replicas refusing DCP_COMMIT for a prepare they did not hold
    (one rebuilt from 0 read past it on disk, where prepares are not; one reconnected after
    that, past its seqno): a stream that did not send the prepare sends the document."""
    prepare = SyncItem(5, b"d", Op.PREPARE, Op.MUTATION, b"v5", 13, level=1)
    committed = prepare.committed(9)
    options = ItemOptions(delete_times=True, sync_writes=True)
    framer = ItemFramer(VB, 77, options)
    data, count, _ = framer.items([committed], 1 << 20)
    [frame] = _frames(data)
    assert (count, frame.opcode) == (1, Opcode.DCP_MUTATION)
    assert (frame.key, frame.value, frame.cas) == (b"d", b"v5", 13)
    framer.items([prepare], 1 << 20)
    data, _, _ = framer.items([committed], 1 << 20)
    assert [f.opcode for f in _frames(data)] == [Opcode.DCP_COMMIT]
    # A prepare ended by a later plain write is forgotten: its commit (deduplicated away)
    # never comes, and a later commit of another prepare of the key is judged on its own.
    framer = ItemFramer(VB, 77, options)
    later = SyncItem(10, b"d", Op.PREPARE, Op.MUTATION, b"v10", 14, level=1)
    framer.items([SyncItem(5, b"d", Op.PREPARE, Op.MUTATION, b"v5", 13, level=1)], 1 << 20)
    framer.items([Item(7, b"d", Op.MUTATION, b"w", 15)], 1 << 20)
    data, _, _ = framer.items([committed], 1 << 20)
    assert [f.opcode for f in _frames(data)] == [Opcode.DCP_MUTATION]
    framer.items([later], 1 << 20)
    data, _, _ = framer.items([later.committed(11)], 1 << 20)
    assert [f.opcode for f in _frames(data)] == [Opcode.DCP_COMMIT]


def test_a_checkpoint_with_a_pending_prepare_stays_in_memory(store: Store) -> None:
    vb = make(store)
    prepared = vb.set(b"p", b"x", level=MAJORITY)
    for i in range(50):
        vb.set(b"k%d" % i, b"y")
        vb.manager.close_open_checkpoint()
    vb.flush()  # the persistence cursor passed everything
    assert vb.manager.first_memory_seqno <= prepared.seqno  # a backfill would not skip it
    vb.commit(b"p")
    vb.flush()
    assert vb.manager.first_memory_seqno > prepared.seqno  # released with the prepare


def _frames(data: bytes) -> list:  # type: ignore[type-arg]
    reader = FrameReader()
    reader.feed(data)
    return reader.frames()


@given(
    seqno=st.integers(1, 2**64 - 1),
    key=st.binary(min_size=1, max_size=250),
    value=st.binary(max_size=64),
    cas=st.integers(1, 2**64 - 1),
    rev=st.integers(1, 2**64 - 1),
    deleted=st.booleans(),
    level=st.integers(1, 3),
    when=st.integers(0, 2**32 - 1),
)
def test_prepare_round_trips(
    seqno: int,
    key: bytes,
    value: bytes,
    cas: int,
    rev: int,
    deleted: bool,
    level: int,
    when: int,
) -> None:
    sent = Prepare(
        VB, 9, seqno, key, value, cas, rev, when, 0 if deleted else when, deleted, level, 1,
        when if deleted else 0,
    )  # fmt: skip
    [frame] = _frames(encode_prepare(sent))
    assert decode_prepare(frame) == sent


@given(
    prepared=st.integers(1, 2**63),
    gap=st.integers(1, 2**63 - 1),
    key=st.binary(min_size=1, max_size=250),
)
def test_abort_round_trips(prepared: int, gap: int, key: bytes) -> None:
    sent = Abort(VB, 9, key, prepared, prepared + gap)
    [frame] = _frames(encode_abort(sent))
    assert decode_abort(frame) == sent


@given(prepared=st.integers(1, 2**63), gap=st.integers(1, 2**63 - 1), key=st.binary(min_size=1))
def test_commit_round_trips(prepared: int, gap: int, key: bytes) -> None:
    sent = Commit(VB, 9, key[:250], prepared, prepared + gap)
    [frame] = _frames(encode_commit(sent))
    assert decode_commit(frame) == sent


def test_a_replica_commits_the_prepare_it_holds_and_refuses_one_it_does_not(store: Store) -> None:
    replica = make(store, VBucketState.REPLICA)
    replica.replica_snapshot(1, 3)
    replica.queue_replicated(SyncItem(1, b"k", Op.PREPARE, Op.MUTATION, b"v", 21, flags=2, level=1))
    with pytest.raises(InvalidArgumentsError):
        replica.replica_commit(b"k", 9, 2)  # not the prepare it holds
    with pytest.raises(InvalidArgumentsError):
        replica.replica_commit(b"other", 1, 2)
    replica.replica_commit(b"k", 1, 2)
    document = replica.get(b"k")
    assert document is not None
    assert (document.value, document.cas, document.flags, document.seqno) == (b"v", 21, 2, 2)
    assert replica.pending_prepares == []


@given(data=st.binary(max_size=200))
def test_the_sync_write_decoders_raise_only_protocol_errors(data: bytes) -> None:
    reader = FrameReader()
    reader.feed(data)
    try:
        frames = reader.frames()
    except ProtocolError:
        return
    for frame in frames:
        for decode in (decode_prepare, decode_abort, decode_commit):
            with contextlib.suppress(ProtocolError):
                decode(frame)


# -- a model: what reads see through durable writes, commits, aborts, flushes and restarts ----

_KEYS = [b"a", b"b", b"c"]
_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["set", "durable", "durable-delete", "commit", "abort", "flush", "restart"]
        ),
        st.sampled_from(_KEYS),
        st.binary(max_size=8),
    ),
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=_ACTIONS)
def test_reads_follow_a_model_of_committed_values(tmp_path: Path, actions: list) -> None:  # type: ignore[type-arg]
    path = tmp_path / f"model-{uuid.uuid4()}"  # hypothesis seeds `random`: not that
    store = Store(path, map_size_bytes=64 * 1024 * 1024, durable=False)
    try:
        vb = make(store)
        committed: dict[bytes, bytes | None] = {}
        pending: dict[bytes, bytes | None] = {}
        for action, key, value in actions:
            if action in ("set", "durable", "durable-delete"):
                level = 0 if action == "set" else MAJORITY
                try:
                    if action == "durable-delete":
                        vb.delete(key, level=level)
                        staged: bytes | None = None
                    else:
                        vb.set(key, value, level=level)
                        staged = value
                except SyncWriteInProgressError:
                    assert key in pending
                    continue
                except KeyNotFoundError:
                    assert committed.get(key) is None
                    continue
                assert key not in pending
                if level:
                    pending[key] = staged
                else:
                    committed[key] = staged
            elif action == "commit":
                if key in pending:
                    vb.commit(key)
                    committed[key] = pending.pop(key)
            elif action == "abort":
                if key in pending:
                    vb.abort(key)
                    del pending[key]
            elif action == "flush":
                vb.flush()
            else:  # a clean restart: pending prepares are committed at warmup
                vb.close()
                store.close()
                store = Store(path, map_size_bytes=64 * 1024 * 1024, durable=False)
                vb = make(store)
                committed.update(pending)
                pending.clear()
            for k in _KEYS:
                document = vb.get(k)
                assert (None if document is None else document.value) == committed.get(k), k
            assert {p.key for p in vb.pending_prepares} == set(pending)
        vb.close()
    finally:
        store.close()


def _markers(vb: VBucket) -> list[SnapshotStart]:
    reader = vb.stream("markers", 0)
    try:
        runs = reader.read_runs(10_000, 1 << 24)
        while reader.has_next:  # bounded: a test's handful of items
            runs += reader.read_runs(10_000, 1 << 24)
    finally:
        reader.close()
    return [run for run in runs if isinstance(run, SnapshotStart)]


def test_markers_carry_the_max_visible_and_a_safe_high_completed_seqno(store: Store) -> None:
    vb = make(store)
    vb.set(b"a", b"1")  # 1
    vb.set(b"p", b"2", level=3)  # 2: persistToMajority, pending
    vb.set(b"q", b"3", level=MAJORITY)  # 3
    vb.commit(b"q")  # 4 commits 3, out of order: 2 is still pending
    vb.set(b"r", b"5", level=MAJORITY)  # 5, pending: the snapshot's last item is invisible
    memory = _markers(vb)[-1]
    assert (memory.snap_end, memory.max_visible_seqno) == (5, 4)
    assert memory.high_completed_seqno == 1  # 3 completed, but 2 is older and pending
    vb.commit(b"p")  # 6
    vb.abort(b"r")  # 7
    memory = _markers(vb)[-1]
    assert (memory.snap_end, memory.max_visible_seqno, memory.high_completed_seqno) == (7, 6, 5)
    abort_only = _markers(vb)[-1]  # the abort took a checkpoint of its own (key r again)
    assert (abort_only.snap_start, abort_only.max_visible_seqno) == (7, 6)
    vb.flush()
    vb.manager.close_open_checkpoint()  # cursorless once flushed: freed, the rest is on disk
    disk = _markers(vb)[0]
    assert disk.from_disk and disk.snap_end == 7
    assert (disk.max_visible_seqno, disk.high_completed_seqno) == (6, 5)  # 7 is the abort
    assert store.vbucket_meta(VB).high_completed_seqno == 5  # type: ignore[union-attr]


def test_replica_streams_get_v2_markers_with_those_seqnos() -> None:
    options = ItemOptions(delete_times=True, sync_writes=True)
    encoder = DcpEncoder(VB, 77, options, marker_version=MarkerVersion.V2_0)
    out: list[bytes] = []
    encoder.snapshot_marker(out, SnapshotStart(1, 9, MARKER_FLAG_DISK, 8, 6), purge_seqno=0)
    [frame] = _frames(b"".join(out))
    marker = decode_snapshot_marker(frame)
    assert marker.version is MarkerVersion.V2_0
    assert (marker.snap_start, marker.snap_end, marker.max_visible_seqno) == (1, 9, 8)
    assert marker.high_completed_seqno == 6
