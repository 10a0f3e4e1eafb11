"""SEQNO_PERSISTENCE waits (server/persistence_waits.py) against a simple model: a wait is done
exactly when its vbucket's persisted seqno has reached its seqno; it fails with TMPFAIL when it
times out, when too many wait, when the store cannot persist or when all are failed; and the
count of pending waits is what the model says."""

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
from changefeed.server.persistence_waits import PersistenceWaits

VBUCKETS = 3


class Node:
    """What the waits see of a bucket: persisted seqnos, store health, hurried flushes."""

    def __init__(self) -> None:
        self.persisted = dict.fromkeys(range(VBUCKETS), 0)
        self.failing: str | None = None
        self.hurried = 0

    def persisted_seqno(self, vb: int) -> int | None:
        return self.persisted.get(vb)

    def check_writable(self) -> None:
        if self.failing:
            raise TemporaryFailureError(self.failing)

    def hurry(self) -> None:
        self.hurried += 1

    def waits(self, timeout_s: float = 30.0) -> PersistenceWaits:
        return PersistenceWaits(
            self.persisted_seqno, self.check_writable, self.hurry, timeout_s=timeout_s
        )


# A step: ("wait", vb, seqno) or ("persist", vb, new persisted seqno).
steps = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.integers(0, VBUCKETS - 1), st.integers(0, 30)),
        st.tuples(st.just("persist"), st.integers(0, VBUCKETS - 1), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(steps=steps)
def test_a_wait_is_done_exactly_when_its_seqno_is_persisted(
    steps: list[tuple[str, int, int]],
) -> None:
    async def scenario() -> None:
        node = Node()
        waits = node.waits()
        made: list[tuple[int, int, asyncio.Future[None]]] = []
        had_to_wait = 0
        for kind, vb, seqno in steps:
            if kind == "wait":
                future = waits.wait(vb, seqno)
                had_to_wait += not future.done()
                made.append((vb, seqno, future))
            else:
                node.persisted[vb] = max(node.persisted[vb], seqno)  # persisted only rises
                waits.on_persisted([vb])
            for wait_vb, wait_seqno, made_future in made:
                assert made_future.done() == (node.persisted[wait_vb] >= wait_seqno)
                if made_future.done():
                    assert made_future.result() is None
            assert waits.count == sum(not f.done() for *_, f in made)
        assert node.hurried == had_to_wait  # each wait that had to wait hurried the flusher
        waits.fail_all("stopping")
        assert waits.count == 0
        assert all(f.done() for *_, f in made)

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
        timed_out = waits.wait(0, 5)
        failed = waits.wait(1, 5)
        waits.fail_all("cannot persist: disk full")
        with pytest.raises(TemporaryFailureError, match="cannot persist: disk full"):
            await failed
        assert timed_out.done()  # fail_all ends every wait
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
