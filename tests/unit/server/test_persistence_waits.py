"""SEQNO_PERSISTENCE waits (server/persistence_waits.py) against a simple model: a wait
succeeds exactly when its vbucket's persisted seqno reaches its seqno on the state and history
it began on; a vbucket that changed meanwhile gets TMPFAIL; a cancelled wait (its connection
closed) ends; the count of pending waits is the model's, and ended waits do not pile up in the
heaps. Also timeouts, the cap, a failing store, fail_all and the request's round trip."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.errors import NotMyVbucketError, TemporaryFailureError
from changefeed.protocol.frame import decode_frame
from changefeed.protocol.kv import decode_seqno_persistence, encode_seqno_persistence
from changefeed.protocol.opcode import Opcode
from changefeed.server.persistence_waits import PersistenceWaits, VbucketMark
from changefeed.vbucket_state import VBucketState

VBUCKETS = 3


class Node:
    """What the waits see of a bucket: marks (persisted seqno, state, history), store
    health, hurried flushes."""

    def __init__(self) -> None:
        self.persisted = dict.fromkeys(range(VBUCKETS), 0)
        self.uuid = dict.fromkeys(range(VBUCKETS), 1)
        self.failing: str | None = None
        self.hurried = 0

    def mark_of(self, vb: int) -> VbucketMark | None:
        if vb not in self.persisted:
            return None
        return VbucketMark(self.persisted[vb], VBucketState.ACTIVE, self.uuid[vb])

    def check_writable(self) -> None:
        if self.failing:
            raise TemporaryFailureError(self.failing)

    def hurry(self) -> None:
        self.hurried += 1

    def waits(self, timeout_s: float = 30.0) -> PersistenceWaits:
        return PersistenceWaits(self.mark_of, self.check_writable, self.hurry, timeout_s=timeout_s)


# A step: ("wait", vb, seqno), ("persist", vb, persisted seqno), ("change", vb, _): a failover
# or rollback gives the vbucket a new history, or ("cancel", index of a wait, _).
steps = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.integers(0, VBUCKETS - 1), st.integers(0, 30)),
        st.tuples(st.just("persist"), st.integers(0, VBUCKETS - 1), st.integers(0, 30)),
        st.tuples(st.just("change"), st.integers(0, VBUCKETS - 1), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 40), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps)
def test_a_wait_ends_as_the_model_says(steps: list[tuple[str, int, int]]) -> None:
    async def scenario() -> None:
        node = Node()
        waits = node.waits()
        made: list[tuple[int, int, int, asyncio.Future[None]]] = []  # vb, seqno, uuid, future
        expected: list[str] = []  # "pending", "ok", "changed", "cancelled"
        had_to_wait = 0
        answered_at_once: list[bool] = []
        for kind, a, b in steps:
            if kind == "wait":
                future = waits.wait(a, b)
                had_to_wait += not future.done()
                answered_at_once.append(future.done())
                made.append((a, b, node.uuid[a], future))
                expected.append("ok" if node.persisted[a] >= b else "pending")
            elif kind == "persist":
                node.persisted[a] = max(node.persisted[a], b)  # persisted only rises
                waits.on_persisted([a])
                for i, (vb, seqno, uuid, _) in enumerate(made):
                    if expected[i] == "pending" and vb == a and node.persisted[vb] >= seqno:
                        expected[i] = "ok" if uuid == node.uuid[vb] else "changed"
            elif kind == "change":
                node.uuid[a] += 1
            elif made:
                i = a % len(made)
                made[i][3].cancel()
                if expected[i] == "pending":
                    expected[i] = "cancelled"
            await asyncio.sleep(0)  # done callbacks run
            for (_, _, _, future), want in zip(made, expected, strict=True):
                if want == "pending":
                    assert not future.done()
                elif want == "ok":
                    assert future.done() and not future.cancelled() and future.result() is None
                elif want == "changed":
                    with pytest.raises(TemporaryFailureError, match="changed state or history"):
                        future.result()
                else:
                    assert future.cancelled()
            pending = expected.count("pending")
            assert waits.count == pending
            assert waits.heap_entries <= 2 * pending + 16  # ended waits do not pile up
        assert node.hurried == had_to_wait  # each wait that had to wait hurried the flusher
        # Counters (STAT persistence_waits_*): every wait asked, and those answered success
        # after waiting (not at once, not changed, not cancelled).
        assert waits.requested_total == len(made)
        answered_late = sum(
            want == "ok" and not at_once
            for want, at_once in zip(expected, answered_at_once, strict=True)
        )
        assert waits.answered_total == answered_late
        waits.fail_all("stopping")
        await asyncio.sleep(0)
        assert waits.count == 0 and waits.heap_entries == 0
        assert all(future.done() for *_, future in made)

    asyncio.run(scenario())


def test_many_waits_timing_out_together_leave_nothing_behind() -> None:
    """A client's waits for a seqno that never comes, all on one vbucket: they time out
    together with TMPFAIL, the heap is rebuilt as they go (no rebuild per wait), and the
    count is back to zero."""

    async def scenario() -> None:
        node = Node()
        waits = node.waits(timeout_s=0.05)
        futures = [waits.wait(0, 2**63 + n) for n in range(5000)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, TemporaryFailureError) for r in results)
        assert waits.count == 0
        assert waits.heap_entries <= 16

    asyncio.run(scenario())


def test_refusals_and_failures() -> None:
    async def scenario() -> None:
        node = Node()
        waits = node.waits(timeout_s=0.05)
        with pytest.raises(NotMyVbucketError, match="vbucket 7"):
            waits.wait(7, 1)
        node.failing = "the store cannot persist (disk full)"
        with pytest.raises(TemporaryFailureError, match="disk full"):
            waits.wait(0, 1)
        assert waits.count == 0 and node.hurried == 0
        node.failing = None
        first = waits.wait(0, 5)
        failed = waits.wait(1, 5)
        waits.fail_all("cannot persist: disk full")
        with pytest.raises(TemporaryFailureError, match="cannot persist: disk full"):
            await failed
        assert first.done()  # fail_all ends every wait
        late = waits.wait(2, 5)
        with pytest.raises(TemporaryFailureError, match="seqno 5 not persisted within"):
            await late
        assert waits.count == 0
        node.persisted[2] = 9
        waits.on_persisted([2])  # nothing left to answer: no error

    asyncio.run(scenario())


def test_at_most_persistence_waits_max_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "PERSISTENCE_WAITS_MAX", 2)

    async def scenario() -> None:
        node = Node()
        waits = node.waits()
        first, second = waits.wait(0, 1), waits.wait(1, 1)
        with pytest.raises(TemporaryFailureError, match="2 persistence waits pending"):
            waits.wait(2, 1)
        assert waits.wait(2, 0).done()  # persisted already: answered, not counted
        node.persisted[0] = 1
        waits.on_persisted([0])
        await asyncio.sleep(0)
        assert first.done() and not second.done()
        third = waits.wait(2, 1)  # room again
        assert waits.count == 2 and not third.done()
        waits.fail_all("stopping")

    asyncio.run(scenario())


@settings(max_examples=100)
@given(
    vb=st.integers(0, 0xFFFF),
    seqno=st.integers(0, limits.SEQNO_MAX),
    opaque=st.integers(0, 2**32 - 1),
)
def test_seqno_persistence_request_round_trips(vb: int, seqno: int, opaque: int) -> None:
    wire = encode_seqno_persistence(vb, seqno, opaque)
    frame = decode_frame(wire, 0, len(wire))
    assert (frame.opcode, frame.vbucket, frame.opaque) == (Opcode.SEQNO_PERSISTENCE, vb, opaque)
    assert decode_seqno_persistence(frame) == seqno
