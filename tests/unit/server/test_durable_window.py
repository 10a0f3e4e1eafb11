"""A window of durable writes decided as runs (`sync_writes.DurableWrites`: one walk per check
that stops at each ack kind's first write not met, the commits of a check queued as one run)
against the one-at-a-time model: after every event, exactly the writes whose level the commit
rule (`durability_met`) says is met have committed, each once, with its own value; a write
that times out first is aborted and answered SYNC_WRITE_AMBIGUOUS. Mixed levels (received
acks for `majority`, persisted acks for `persistToMajority`) interleave in one vbucket, so a
write can commit before an earlier one of the other kind. Real vbuckets on a real store, a
real `ReplicationTracker`; no event loop (the decisions are sans-IO)."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from changefeed.protocol.errors import (
    StatusError,
    SyncWriteAmbiguousError,
    SyncWriteInProgressError,
)
from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.protocol.kv import MutationResult
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import DurableWrites, Waiter, durability_met
from changefeed.storage import Store
from changefeed.vbucket import VBucket

VBS = (0, 1)
REPLICAS = ("r1", "r2")  # a chain of three: a majority is two copies
REQUIRED = {0: (), 1: ("r2",)}  # vb 1's in-sync record names r2: every commit needs it
LEVELS = (
    DurabilityLevel.MAJORITY,
    DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
    DurabilityLevel.PERSIST_TO_MAJORITY,
)

prepare = st.tuples(st.just("prepare"), st.sampled_from(VBS), st.integers(0, 5),
                    st.sampled_from(LEVELS))  # fmt: skip
flush = st.tuples(st.just("flush"), st.sampled_from(VBS))
ack = st.tuples(st.just("ack"), st.sampled_from(VBS), st.sampled_from(REPLICAS),
                st.integers(0, 4), st.integers(0, 4))  # fmt: skip
expire = st.tuples(st.just("expire"), st.integers(0, 40))
events = st.lists(st.one_of(prepare, prepare, flush, ack, expire), min_size=1, max_size=60)


@dataclass
class Written:
    waiter: Waiter
    value: bytes
    answers: list[MutationResult | StatusError]
    outcome: str = "waiting"  # the model's: waiting, committed, ambiguous


def expected_met(written: Written, vbucket: VBucket, tracker: ReplicationTracker) -> bool:
    """The one-at-a-time rule for one write, as `DurableWrites` applied it before runs."""
    waiter = written.waiter
    persisted = waiter.level is DurabilityLevel.PERSIST_TO_MAJORITY

    def ack_of(replica: str) -> int:
        progress = tracker.progress(waiter.vb, replica)
        return progress.persisted_seqno if persisted else progress.received_seqno

    return durability_met(
        waiter.seqno,
        vbucket.persisted_seqno,
        [ack_of(r) for r in REPLICAS],
        [ack_of(r) for r in REQUIRED[waiter.vb]],
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
@example(  # a persistToMajority write waits on persisted acks; the majority one after it commits
    [("prepare", 0, 0, DurabilityLevel.PERSIST_TO_MAJORITY),
     ("prepare", 0, 1, DurabilityLevel.MAJORITY), ("flush", 0), ("ack", 0, "r1", 4, 4)]
)  # fmt: skip
def test_a_window_of_mixed_levels_commits_and_aborts_as_one_at_a_time(
    script: list[tuple[object, ...]],
) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = Store(Path(root), map_size_bytes=64 << 20, durable=False)
        try:
            run_script(store, script)
        finally:
            store.close()


def run_script(store: Store, script: list[tuple[object, ...]]) -> None:
    vbuckets = {vb: VBucket(store, vb, rng=random.Random(vb)) for vb in VBS}
    tracker = ReplicationTracker(lambda vb: vbuckets[vb].high_seqno, lag_max_s=10.0,
                                 clock=lambda: 0.0)  # fmt: skip
    for vb in VBS:
        for replica in REPLICAS:
            tracker.stream_opened(vb, replica, 0)
    decisions = DurableWrites(vbuckets.__getitem__, replicas_of=lambda vb: REPLICAS,
                              replication=tracker, required_of=REQUIRED.__getitem__)  # fmt: skip
    written: list[Written] = []
    for number, event in enumerate(script):
        kind = event[0]
        if kind == "prepare":
            _, vb, key_number, level = event
            assert isinstance(vb, int) and isinstance(level, DurabilityLevel)
            key, value = b"k%d" % key_number, b"v%d" % number
            try:
                prepared = vbuckets[vb].set(key, value, level=int(level))
            except SyncWriteInProgressError:  # the key's earlier durable write still waits
                assert any(w.outcome == "waiting" and w.waiter.key == key and w.waiter.vb == vb
                           for w in written)  # fmt: skip
                continue
            answers: list[MutationResult | StatusError] = []
            waiter = Waiter(vb, key, prepared.seqno, level, answers.append)
            written.append(Written(waiter, value, answers))
            decisions.add(waiter)
        elif kind == "flush":
            vb = event[1]
            assert isinstance(vb, int)
            vbuckets[vb].flush()
            decisions.on_persisted([vb])
        elif kind == "ack":
            _, vb, replica, received_step, persisted_behind = event
            assert isinstance(vb, int) and isinstance(replica, str)
            assert isinstance(received_step, int) and isinstance(persisted_behind, int)
            progress = tracker.progress(vb, replica)
            received = min(vbuckets[vb].high_seqno, progress.received_seqno + received_step)
            tracker.acknowledged(vb, replica, received, max(0, received - persisted_behind))
            decisions.on_progress(vb)
        else:
            index = event[1]
            assert isinstance(index, int)
            if index < len(written) and written[index].outcome == "waiting":
                target = written[index]
                assert decisions.expire(target.waiter)
                target.outcome = "ambiguous"
                assert vbuckets[target.waiter.vb].pending_prepare(target.waiter.key) is None
        for item in written:  # the model: every waiting write whose rule holds commits
            if item.outcome == "waiting" and expected_met(item, vbuckets[item.waiter.vb], tracker):
                item.outcome = "committed"
        check(written, vbuckets, decisions)


def check(written: list[Written], vbuckets: dict[int, VBucket], decisions: DurableWrites) -> None:
    waiting = 0
    for item in written:
        waiter = item.waiter
        # What the shells' deadline queues ask without a lookup agrees with the lookup.
        assert decisions.was_answered(waiter) is (not decisions.is_waiting(waiter)), item
        assert decisions.was_answered(waiter) is (item.outcome != "waiting"), item
        if item.outcome == "waiting":
            waiting += 1
            assert item.answers == [], item
            assert vbuckets[waiter.vb].pending_prepare(waiter.key) is not None
            continue
        assert len(item.answers) == 1, item
        answer = item.answers[0]
        if item.outcome == "ambiguous":
            assert isinstance(answer, SyncWriteAmbiguousError), item
            continue
        assert isinstance(answer, MutationResult), item
        assert answer.seqno > waiter.seqno and answer.vbucket == waiter.vb
    assert decisions.pending_count == waiting
    for vb, vbucket in vbuckets.items():
        # The newest committed write of each key is what a read sees (aborts show nothing).
        newest: dict[bytes, Written] = {}
        for item in written:
            if item.waiter.vb == vb and item.outcome == "committed":
                newest[item.waiter.key] = item
        for key, item in newest.items():
            assert vbucket.get(key).value == item.value, (vb, key)
        seqnos = [
            w.answers[0].seqno
            for w in written
            if w.waiter.vb == vb and w.outcome == "committed"
            and isinstance(w.answers[0], MutationResult)
        ]  # fmt: skip
        assert len(set(seqnos)) == len(seqnos)  # a commit each, its own seqno
