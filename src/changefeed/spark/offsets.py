"""Spark offsets: per vbucket ``{vb_uuid, seqno, snap_start, snap_end}``, as JSON.

An offset is a consumer session state in Spark's checkpoint: a restarted query presents it on its
stream requests, so the node detects a diverged history and answers with a rollback (invariant 2).
An end offset computed at planning claims the whole range up to ``seqno`` (``snap_start =
snap_end = seqno``): the micro-batch reads every item up to it and drops items past it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from changefeed.consumer.session import VbSession
from changefeed.failover import FailoverLog


@dataclass(frozen=True, slots=True)
class VbOffset:
    vb_uuid: int = 0
    seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "vb_uuid": self.vb_uuid,
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> VbOffset:
        """Raises ValueError for a malformed offset."""
        if not isinstance(raw, dict):
            raise ValueError(f"offset must be an object, not {raw!r}")
        try:
            seqno = int(raw["seqno"])
            offset = cls(
                vb_uuid=int(raw.get("vb_uuid", 0)),
                seqno=seqno,
                snap_start=int(raw.get("snap_start", seqno)),
                snap_end=int(raw.get("snap_end", seqno)),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"offset {raw!r} is invalid: {error}") from None
        if not offset.snap_start <= offset.seqno <= offset.snap_end:
            raise ValueError(f"offset {raw!r} breaks snap_start <= seqno <= snap_end")
        if min(offset.vb_uuid, offset.seqno) < 0:
            raise ValueError(f"offset {raw!r} has negative numbers")
        return offset

    def session(self, vb: int) -> VbSession:
        """The consumer session that resumes from this offset."""
        log = FailoverLog([(self.vb_uuid, 0)]) if self.vb_uuid else None
        return VbSession(vb, self.seqno, self.snap_start, self.snap_end, log)


Offsets = dict[int, VbOffset]


def offsets_to_json(offsets: Offsets) -> dict[str, Any]:
    return {str(vb): o.to_dict() for vb, o in sorted(offsets.items())}


def offsets_from_json(raw: dict[str, Any]) -> Offsets:
    """Raises ValueError naming the bad vbucket."""
    out: Offsets = {}
    for key, value in raw.items():
        if not str(key).isdigit():
            raise ValueError(f"offset key {key!r} is not a vbucket id")
        out[int(key)] = VbOffset.from_dict(value)
    return out


def limit_offsets(start: Offsets, latest: Offsets, max_seqnos: int) -> Offsets:
    """Move from ``start`` toward ``latest`` by at most ``max_seqnos`` seqnos in total.

    The budget is shared fairly: each vbucket gets an equal share, and what a vbucket cannot
    use goes to the others. Seqnos bound rows (dedup only removes rows), so the limit holds.
    """
    assert max_seqnos > 0, max_seqnos
    wanted = {vb: max(0, o.seqno - start.get(vb, VbOffset()).seqno) for vb, o in latest.items()}
    grant = dict.fromkeys(wanted, 0)
    budget = max_seqnos
    while budget > 0:  # bounded: each round grants >= 1 seqno or stops
        hungry = [vb for vb in sorted(wanted) if grant[vb] < wanted[vb]]
        if not hungry:
            break
        share = max(1, budget // len(hungry))
        for vb in hungry:
            take = min(share, wanted[vb] - grant[vb], budget)
            grant[vb] += take
            budget -= take
            if budget == 0:
                break
    out: Offsets = {}
    for vb, target in latest.items():
        if grant[vb] == wanted[vb]:
            out[vb] = target
            continue
        seqno = start.get(vb, VbOffset()).seqno + grant[vb]
        out[vb] = VbOffset(target.vb_uuid, seqno, seqno, seqno)
    assert sum(grant.values()) <= max_seqnos, (grant, max_seqnos)
    return out
