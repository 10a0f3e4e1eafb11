"""Each vbucket's committed position and the resolved watermark, recorded in the mirror's commits.

Every mirror commit of the distributed writer carries, in its Delta commit info (key
``changefeed``), the position of every vbucket the stream has brought: the seqno and CAS of its
last committed change. A CAS is the node's hybrid logical clock: its upper 48 bits are
nanoseconds since the epoch, the low 16 a counter (``hlc_ns``), and it rises with the seqno within
a vbucket. So every change of vbucket V whose HLC time is at most V's committed time is in the
tables, and the **resolved watermark**, the minimum of those times over the vbuckets, is a time T
such that every change of every vbucket up to T is in the tables:
``SELECT … WHERE cas < resolved_hlc_ns + 65536`` over the changelog is complete.

It never runs ahead of a vbucket's committed position (a property test checks it against a
model), and is conservative:

- a vbucket with no new change holds the watermark at its last change's time (the source does
  not tell the sink that a vbucket is idle and caught up);
- a rollback whose batch ends a vbucket at the rollback row sets that vbucket's time to 0
  (unknown) until its next change: the watermark falls to 0, it never claims lost history;
- vbuckets that never had a change are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

METADATA_KEY: Final = "changefeed"
_HLC_COUNTER_BITS: Final = 16
HISTORY_SCAN_MAX: Final = 100  # commits searched for the newest position record


def hlc_ns(cas: int) -> int:
    """The physical time of a hybrid-logical-clock CAS, nanoseconds since the epoch."""
    if cas < 0:
        raise ValueError(f"CAS {cas} is negative")
    return (cas >> _HLC_COUNTER_BITS) << _HLC_COUNTER_BITS


@dataclass(frozen=True)
class Position:
    seqno: int
    cas: int  # 0: the time is unknown (a rollback ended the vbucket's batch)


def advance(
    before: Mapping[int, Position], batch: Iterable[tuple[int, int, int]]
) -> dict[int, Position]:
    """The positions after a batch: ``batch`` holds ``(vbucket, seqno, cas)`` of each vbucket's
    last row in it (``cas`` 0 after a rollback row)."""
    after = dict(before)
    for vbucket, seqno, cas in batch:
        after[int(vbucket)] = Position(int(seqno), int(cas))
    return after


def resolved_ns(positions: Mapping[int, Position]) -> int:
    """The resolved watermark (ns since the epoch; 0: nothing resolved)."""
    if not positions:
        return 0
    return min(hlc_ns(p.cas) if p.cas else 0 for p in positions.values())


def to_metadata(positions: Mapping[int, Position], batch_id: int, groups: int) -> dict[str, Any]:
    return {
        "batch": batch_id, "groups": groups, "resolvedHlcNs": resolved_ns(positions),
        "positions": {str(vb): [p.seqno, p.cas] for vb, p in sorted(positions.items())},
    }  # fmt: skip


def from_metadata(record: Mapping[str, Any]) -> dict[int, Position]:
    raw = record.get("positions", {})
    return {int(vb): Position(int(v[0]), int(v[1])) for vb, v in raw.items()}


def latest_record(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest commit's ``changefeed`` record in a Delta history (newest first)."""
    for commit in history:
        record = commit.get(METADATA_KEY)
        if isinstance(record, dict):
            return record
    return None
