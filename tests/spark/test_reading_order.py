"""The reader's row order around events that change a vbucket's snapshot or end
(``spark/reading.py``): changes wait in ``PendingChanges`` to become rows in runs, and are
settled before a snapshot marker, a rollback and a branch change (``_settle``).

The event streams are scripted at the DCP client's boundary (``dcp_client``): a node cannot be
made to deliver a rollback or a new branch right after a reconnect, with changes still pending,
on demand. Everything below the client (rows, runs, end seqnos, rollback rows) is the real code.
Each test fails when the ``_settle`` call before its event is removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

import changefeed.spark.reading as reading
from changefeed.consumer.events import (
    Changes,
    Disconnected,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
)
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import StreamEndReason
from changefeed.protocol.dcp_items import Mutation, encode_mutation
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange, read_chunks_sync

UUID = 77  # the branch the planner saw
NEW_UUID = 78  # a branch made by a failover after it
END = 6  # the micro-batch's end seqno

Row = tuple[str, int, int, int]  # op, seqno, snap_start, snap_end


def changes(*seqnos: int) -> Changes:
    raw = b"".join(encode_mutation(Mutation(0, 1, s, b"k%d" % s, b"v", cas=s)) for s in seqnos)
    return Changes(decode_batch(raw).changes)


def read(monkeypatch: pytest.MonkeyPatch, events: list[Any], seqno: int = 0) -> list[Row]:
    """The rows ``read_chunks`` makes of vbucket 0 from ``events`` (its client's stream; the
    session's seqno for vbucket 0 is ``seqno``)."""

    class Client:
        stream_filter = None
        session = SimpleNamespace(get=lambda vb: SimpleNamespace(seqno=seqno))

        async def stream(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def events(self) -> AsyncIterator[Any]:
            for event in events:
                yield event

    @contextlib.asynccontextmanager
    async def scripted_client(options: Any, config: Any) -> AsyncIterator[Client]:
        yield Client()

    monkeypatch.setattr(reading, "dcp_client", scripted_client)
    options = SourceOptions.parse({"cluster": "127.0.0.1:1", "failOnDataLoss": "false"})
    ranges = [VbRange(0, VbOffset(UUID, 0, 0, 0), END, UUID)]
    rows = [row for chunk in read_chunks_sync(options, ranges) for row in chunk.batch.to_pylist()]
    return [(r["op"], r["seqno"], r["snap_start"], r["snap_end"]) for r in rows]


def test_each_change_keeps_its_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    got = read(monkeypatch, [
        StreamOpened(0, [(UUID, 0)]), Snapshot(0, 1, 3, 0), changes(1, 2, 3),
        Snapshot(0, 4, 6, 0), changes(4, 5, 6), StreamEnded(0, StreamEndReason.OK),
    ])  # fmt: skip
    assert got == [("mutation", 1, 1, 3), ("mutation", 2, 1, 3), ("mutation", 3, 1, 3),
                   ("mutation", 4, 4, 6), ("mutation", 5, 4, 6), ("mutation", 6, 4, 6)]  # fmt: skip


def test_a_rollback_row_follows_the_changes_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reconnect after changes 1..4; the new active rolls the stream back to 2.
    got = read(monkeypatch, [
        StreamOpened(0, [(UUID, 0)]), Snapshot(0, 1, 4, 0), changes(1, 2, 3, 4),
        Disconnected("node 1"), StreamOpened(0, [(UUID, 0)]),
        Rollback(0, 2), Snapshot(0, 3, 6, 0), changes(3, 4, 5, 6),
        StreamEnded(0, StreamEndReason.OK),
    ])  # fmt: skip
    assert got == [("mutation", 1, 1, 4), ("mutation", 2, 1, 4), ("mutation", 3, 1, 4),
                   ("mutation", 4, 1, 4), ("rollback", 2, 2, 2), ("mutation", 3, 3, 6),
                   ("mutation", 4, 3, 6), ("mutation", 5, 3, 6),
                   ("mutation", 6, 3, 6)], got  # fmt: skip


def test_changes_before_a_branch_keep_the_end_they_arrived_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Changes 1..5 arrive on the planned branch; after a reconnect the node's failover log
    shows a branch at 4, which lowers the vbucket's end to 4. The changes that arrived before
    it are rows under the end in force then (6): 5 is kept (the next micro-batch's stream
    request meets the branch and its rollback voids 5 explicitly). The reader holds 5 already,
    past the branch, so the vbucket is finished."""
    got = read(monkeypatch, [
        StreamOpened(0, [(UUID, 0)]), Snapshot(0, 1, 6, 0), changes(1, 2, 3, 4, 5),
        Disconnected("node 1"), StreamOpened(0, [(NEW_UUID, 4), (UUID, 0)]),
        changes(5), StreamEnded(0, StreamEndReason.OK),
    ], seqno=5)  # fmt: skip
    assert got == [("mutation", s, 1, 6) for s in range(1, 6)], got
