"""Per-vbucket resume state of a DCP consumer, and its JSON form (dcp-wire.md §9, §13).

A ``VbSession`` is what a consumer must keep to resume a stream without gaps: the producer's
failover log (replaced on every successful stream request), the last seqno received and the
range of the snapshot it belongs to. A ``SessionState`` maps vbuckets to sessions and
serializes to JSON so a restarted process (a Spark query, ``changefeed stream --resume``) picks
up exactly where it stopped.

Resume rule: the request must satisfy ``snap_start <= start <= snap_end``. A marker for a new
snapshot arrives only after the previous snapshot completed, so while no item of the new
snapshot has arrived yet the consumer still holds the complete previous one and resumes from
``(seqno, seqno, seqno)``.

Bound: a session's size does not grow with the stream. The failover log holds at most 25
entries; the consistent points (snapshot ends the consumer held whole, kept for rollbacks) at
most ``CONSISTENT_POINTS_MAX``: every way a point is added goes through `thin_consistent_points`
(the newest half kept exact, the older half thinned to every other point, repeated until the
list fits), and a state saved by an older build with more points is repaired the same way when
it is loaded, never refused.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from changefeed.failover import FailoverLog
from changefeed.protocol.collections import StreamFilter, decode_stream_filter
from changefeed.protocol.errors import ProtocolError

FILTER_KEY = "filter"  # the collection filter the streams were requested with (issue 28)

# Recent snapshot ends kept per vbucket; older ones are thinned, not dropped. 64 points x ~20
# bytes of JSON is ~1.3 KB per vbucket: a 1024-vbucket state stays under ~1.5 MB however long the
# reader runs. The thinning halves the older half, so it needs at least 4 to make progress.
CONSISTENT_POINTS_MAX = 64
assert CONSISTENT_POINTS_MAX >= 4, CONSISTENT_POINTS_MAX


def thin_consistent_points(points: list[int], bound: int = CONSISTENT_POINTS_MAX) -> list[int]:
    """`points` (ascending, unique) cut to at most `bound`: while too many, the older half is
    thinned to every other point and the newer half kept exact. The oldest and the newest point
    always stay, so coverage of old history stays, with coarser steps (a rollback there re-reads
    more); the newest ``bound // 2`` points are exact. Returns `points` itself when it fits."""
    assert bound >= 4, bound
    while len(points) > bound:  # each round drops about a quarter: O(log n) rounds
        half = len(points) // 2
        points = points[:half:2] + points[half:]
    return points


@dataclass(slots=True)
class VbSession:
    """Resume state of one vbucket. ``failover_log`` is None until a stream request succeeded."""

    vbucket: int
    seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    failover_log: FailoverLog | None = None
    purge_seqno: int = 0  # last purge seqno seen in a V2.2 marker
    # Seqnos at which this consumer held a whole snapshot (ascending; 0 is implicit). After a
    # rollback to R the consumer's data is consistent only at such a point <= R: inside a
    # snapshot, deduplication may have replaced a key's older version that R still needs.
    consistent_points: list[int] = field(default_factory=list)
    # The newest collections manifest uid this stream's system events carried (0: none): a
    # resume presents it (stream-request "uid"), so a node that has not applied that manifest
    # yet answers COLLECTIONS_MANIFEST_IS_AHEAD instead of streaming without its collections.
    # Kept across rollbacks: a node's manifest never goes back, whatever its vbuckets did.
    manifest_uid: int = 0

    def __post_init__(self) -> None:
        if self.seqno and self.seqno == self.snap_end and not self.consistent_points:
            self.consistent_points.append(self.seqno)
        self.consistent_points = thin_consistent_points(self.consistent_points)
        assert len(self.consistent_points) <= CONSISTENT_POINTS_MAX, len(self.consistent_points)

    @property
    def vb_uuid(self) -> int:
        """The uuid to present on a stream request: the newest failover entry, or 0."""
        return 0 if self.failover_log is None else self.failover_log.latest[0]

    def copy(self) -> VbSession:
        """An independent copy (the failover log is rebuilt from its entries)."""
        log = None if self.failover_log is None else FailoverLog(self.failover_log.entries)
        return VbSession(
            self.vbucket,
            self.seqno,
            self.snap_start,
            self.snap_end,
            log,
            self.purge_seqno,
            list(self.consistent_points),
            self.manifest_uid,
        )

    def request_range(self) -> tuple[int, int, int]:
        """``(start, snap_start, snap_end)`` to present on the next stream request."""
        if self.snap_start <= self.seqno <= self.snap_end:
            return self.seqno, self.snap_start, self.snap_end
        # A marker arrived but none of its items: we hold the previous snapshot whole.
        return self.seqno, self.seqno, self.seqno

    def on_marker(self, snap_start: int, snap_end: int) -> None:
        assert snap_start <= snap_end, (snap_start, snap_end)
        self.snap_start = snap_start
        self.snap_end = snap_end

    def on_item(self, seqno: int) -> None:
        """Record a received item; seqnos must rise (invariant 3)."""
        assert seqno > self.seqno, (self.vbucket, seqno, self.seqno)
        self.seqno = seqno
        if seqno == self.snap_end:
            self.add_consistent_point(seqno)

    def on_system_event(self, seqno: int, manifest_uid: int) -> None:
        """A DCP_SYSTEM_EVENT at ``seqno`` of manifest ``manifest_uid``: a change of the
        stream, and the manifest the stream is now at (never lowered)."""
        self.on_item(seqno)
        self.manifest_uid = max(self.manifest_uid, manifest_uid)

    def on_seqno_advanced(self, seqno: int) -> None:
        """DCP_SEQNO_ADVANCED: the stream moved to ``seqno`` over changes it does not carry
        (other collections); at the snapshot's end that is a consistent point. A seqno not
        past the current one changes nothing."""
        if seqno > self.seqno:
            self.on_item(seqno)

    def on_items(self, seqnos: NDArray[np.uint64]) -> None:
        """Record a run of received items of this vbucket at once: what ``on_item`` on each
        would do, checked and applied with array operations (no Python step per item)."""
        assert seqnos.ndim == 1, seqnos.shape
        if not len(seqnos):
            return
        first, last = int(seqnos[0]), int(seqnos[-1])
        assert first > self.seqno, (self.vbucket, first, self.seqno)
        assert bool(np.all(seqnos[1:] > seqnos[:-1])), (self.vbucket, "seqnos do not rise")
        self.seqno = last
        # Rising seqnos hold snap_end at most once; on_item adds it when it arrives.
        if first <= self.snap_end <= last:
            at = int(np.searchsorted(seqnos, self.snap_end))
            if int(seqnos[at]) == self.snap_end:
                self.add_consistent_point(self.snap_end)

    def consistent_point_at_or_below(self, seqno: int) -> int:
        """The newest seqno <= ``seqno`` at which this consumer held a whole snapshot."""
        return max((p for p in self.consistent_points if p <= seqno), default=0)

    def rollback_to(self, seqno: int) -> None:
        """Forget everything after ``seqno`` (dcp-wire.md §9.1, client handling)."""
        if self.failover_log is not None:
            self.failover_log.prune_after(seqno)
        self.seqno = self.snap_start = self.snap_end = seqno
        self.consistent_points = [p for p in self.consistent_points if p < seqno]
        if seqno:
            self.consistent_points.append(seqno)
        self.consistent_points = thin_consistent_points(self.consistent_points)
        assert len(self.consistent_points) <= CONSISTENT_POINTS_MAX, len(self.consistent_points)

    def add_consistent_point(self, seqno: int) -> None:
        """Record that the consumer holds a whole snapshot at `seqno` (at most the bound are
        kept: see `thin_consistent_points`). A point at or below the newest is ignored."""
        assert seqno > 0, seqno
        points = self.consistent_points
        if points and points[-1] >= seqno:
            return
        points.append(seqno)
        self.consistent_points = thin_consistent_points(points)
        assert len(self.consistent_points) <= CONSISTENT_POINTS_MAX, len(self.consistent_points)
        assert self.consistent_points[-1] == seqno, (self.consistent_points[-1], seqno)

    def check_invariants(self) -> None:
        """O(n) checks the tests run after every step: the bound, and the points ascending,
        positive and at or below the seqno."""
        points = self.consistent_points
        assert len(points) <= CONSISTENT_POINTS_MAX, (self.vbucket, len(points))
        assert all(a < b for a, b in itertools.pairwise(points)), (self.vbucket, points)
        if points:
            assert points[0] > 0, (self.vbucket, points[0])
            assert points[-1] <= self.seqno, (self.vbucket, points[-1], self.seqno)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
            "purge_seqno": self.purge_seqno,
            "failover_log": None if self.failover_log is None else self.failover_log.to_list(),
            "consistent_points": list(self.consistent_points),
        }
        if self.manifest_uid:
            out["manifest_uid"] = f"{self.manifest_uid:x}"
        return out

    @classmethod
    def from_dict(cls, vbucket: int, raw: dict[str, Any]) -> VbSession:
        """Raises ValueError (with the vbucket) for a malformed entry.

        Consistent points are repaired, not refused: a state saved by an older build may hold
        any number of them (it grew one per shared-memory batch), unsorted or repeated, or past
        the seqno. They are sorted, deduplicated, cut to ``0 < point <= seqno`` and thinned to
        the bound, which only ever makes a rollback re-read more, never less.
        """
        try:
            log = raw.get("failover_log")
            seqno = int(raw["seqno"])
            points = sorted({int(p) for p in raw.get("consistent_points", [])})
            session = cls(
                vbucket,
                seqno=seqno,
                snap_start=int(raw["snap_start"]),
                snap_end=int(raw["snap_end"]),
                failover_log=None if log is None else FailoverLog.from_list(log),
                purge_seqno=int(raw.get("purge_seqno", 0)),
                consistent_points=[p for p in points if 0 < p <= seqno],
                manifest_uid=int(raw.get("manifest_uid", "0"), 16),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"session state for vbucket {vbucket} is invalid: {error}") from None
        if not session.snap_start <= session.snap_end:
            raise ValueError(f"session state for vbucket {vbucket}: snap_start > snap_end")
        if session.manifest_uid < 0:
            raise ValueError(f"session state for vbucket {vbucket}: manifest_uid is negative")
        return session


@dataclass(slots=True)
class SessionState:
    """Resume state of every streamed vbucket; JSON-serializable.

    Attributes:
        stream_filter: the collections the streams carry (None: a client that did not
            negotiate collections, the default collection). Positions are only valid for the
            same filter: a resume with another one would skip what the first one filtered out.
    """

    vbuckets: dict[int, VbSession] = field(default_factory=dict)
    stream_filter: StreamFilter | None = None

    def get(self, vbucket: int) -> VbSession:
        session = self.vbuckets.get(vbucket)
        if session is None:
            session = self.vbuckets[vbucket] = VbSession(vbucket)
        return session

    def on_items(
        self, vbuckets: NDArray[np.unsignedinteger[Any]], seqnos: NDArray[np.uint64]
    ) -> None:
        """Record a run of received items (wire order, any vbuckets): one step per vbucket."""
        assert vbuckets.shape == seqnos.shape, (vbuckets.shape, seqnos.shape)
        for vbucket, run in _by_vbucket(vbuckets, seqnos):
            self.get(vbucket).on_items(run)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (vbucket as a string -> its session), for embedding in a larger
        document (``changefeed stream`` saves it beside where its output was synced)."""
        out: dict[str, Any] = {str(vb): s.to_dict() for vb, s in sorted(self.vbuckets.items())}
        if self.stream_filter is not None:
            out[FILTER_KEY] = json.loads(self.stream_filter.to_json() or b"{}")
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> SessionState:
        """Raises ValueError with a clear message for malformed state."""
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise ValueError(f"session state is not JSON: {error}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: object) -> SessionState:
        """``to_dict``'s form, as decoded from JSON. Raises ValueError for malformed state."""
        if not isinstance(raw, dict):
            raise ValueError("session state must be a JSON object of vbucket -> state")
        state = cls()
        for key, value in raw.items():
            if key == FILTER_KEY and isinstance(value, dict):
                try:
                    state.stream_filter = decode_stream_filter(json.dumps(value).encode())
                except (ValueError, ProtocolError) as error:
                    raise ValueError(f"session state filter {value!r}: {error}") from None
                continue
            if not str(key).isdigit() or not isinstance(value, dict):
                raise ValueError(f"session state entry {key!r} is invalid")
            state.vbuckets[int(key)] = VbSession.from_dict(int(key), value)
        return state


def _by_vbucket(
    vbuckets: NDArray[np.unsignedinteger[Any]], seqnos: NDArray[np.uint64]
) -> Iterator[tuple[int, NDArray[np.uint64]]]:
    """``(vbucket, its seqnos in wire order)`` for each vbucket present, in ascending order."""
    if not len(vbuckets):
        return
    if bool(np.all(vbuckets == vbuckets[0])):  # the usual run: one vbucket
        yield int(vbuckets[0]), seqnos
        return
    order = np.argsort(vbuckets, kind="stable")  # stable: wire order within a vbucket
    ordered = vbuckets[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), len(order)]
    for start, stop in itertools.pairwise(bounds):  # one step per vbucket
        yield int(ordered[start]), seqnos[order[start:stop]]
