"""How far a reader (the mirror) is behind the node, per vbucket and in total.

- items: the high seqno (of the vbucket's active node, on a cluster) minus the committed
  seqno (seqnos, so an upper bound on the changes still to read: deduplication may have
  merged some);
- age: seconds since the oldest change not yet committed was written. It is read from that
  change's CAS, which the node takes from its hybrid clock (nanoseconds since the epoch,
  ``vbucket.py``): the first change after the committed offset is fetched over DCP, only for
  vbuckets with items to go. A vbucket whose history changed (another vb_uuid) has no age.

``measure_lag_sync`` reads the ages over DCP (``changefeed mirror status``, the job's progress
line). ``LagTracker``, for the source's runner that plans every micro-batch, reads them once
and then dates new changes by when its polls first saw the high seqno pass them (the previous
poll's time: an age at most one poll interval too high), so planning costs no DCP read. Neither
raises: planning a micro-batch must not fail because the lag could not be measured; an age it
could not read is ``None``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from changefeed.consumer import (
    Changes,
    Rollback,
    SessionState,
    StreamEnded,
    StreamRefused,
)
from changefeed.spark.cluster import client_config, dcp_client
from changefeed.spark.offsets import Offsets, VbOffset
from changefeed.spark.options import SourceOptions

log = logging.getLogger("changefeed.lag")

AGE_READ_TIMEOUT_S: Final = 5.0  # reading the first pending change of every lagging vbucket
# Each vbucket's read ends this many seqnos after the committed one: a backlog of millions is
# not streamed to find its first change (a window that deduplication emptied gives no age).
AGE_WINDOW_SEQNOS: Final = 256


@dataclass(frozen=True, slots=True)
class VbLag:
    vbucket: int
    high_seqno: int
    committed_seqno: int
    age_s: float | None  # None: nothing pending, or unknown

    @property
    def items(self) -> int:
        return max(0, self.high_seqno - self.committed_seqno)


@dataclass(frozen=True, slots=True)
class Lag:
    vbuckets: list[VbLag]
    measured_at: float  # time.time()

    @property
    def items(self) -> int:
        return sum(v.items for v in self.vbuckets)

    @property
    def age_s(self) -> float:
        """Age of the oldest pending change over all vbuckets (0 when nothing is pending)."""
        return max((v.age_s for v in self.vbuckets if v.age_s is not None), default=0.0)

    def to_json(self) -> dict[str, Any]:
        """``{"items": N, "ageS": s, "vbuckets": {"vb": [items, ageS], ...}}`` (lagging only)."""
        return {
            "items": self.items,
            "ageS": round(self.age_s, 3),
            "measuredAt": round(self.measured_at, 3),
            "vbuckets": {
                str(v.vbucket): [v.items, None if v.age_s is None else round(v.age_s, 3)]
                for v in self.vbuckets
                if v.items
            },
        }


def measure_lag_sync(options: SourceOptions, committed: Offsets, latest: Offsets) -> Lag:
    """The lag of ``committed`` behind ``latest`` (the node's high seqnos), with ages."""
    now = time.time()
    written = _first_change_times(options, committed, latest)
    vbuckets = [
        VbLag(
            vb,
            o.seqno,
            committed.get(vb, VbOffset()).seqno,
            max(0.0, now - written[vb]) if vb in written else None,
        )
        for vb, o in sorted(latest.items())
    ]
    return Lag(vbuckets, now)


class LagTracker:
    """Lag from successive polls of the node's high seqnos (see the module docstring)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        # vbucket -> [(seqno, when the oldest change up to that seqno was written)], rising
        self._written: dict[int, list[tuple[int, float]]] = {}
        self._last_poll: float | None = None

    def update(self, committed: Offsets, latest: Offsets) -> Lag:
        now = time.time()
        if self._last_poll is None:  # nothing seen yet: read when the pending changes were written
            for vb, at in _first_change_times(self.options, committed, latest).items():
                self._written[vb] = [(latest[vb].seqno, at)]
        vbuckets = []
        for vb, offset in sorted(latest.items()):
            done = committed.get(vb, VbOffset()).seqno
            marks = [m for m in self._written.get(vb, []) if done < m[0] <= offset.seqno]
            if offset.seqno > max((m[0] for m in marks), default=done):
                marks.append((offset.seqno, self._last_poll if self._last_poll else now))
            self._written[vb] = marks
            age = max(0.0, now - marks[0][1]) if marks else None
            vbuckets.append(VbLag(vb, offset.seqno, done, age))
        self._last_poll = now
        return Lag(vbuckets, now)


def _first_change_times(
    options: SourceOptions, committed: Offsets, latest: Offsets
) -> dict[int, float]:
    """vbucket -> when its first change after ``committed`` was written (seconds since the
    epoch, from the change's CAS), for the vbuckets with changes pending; empty on failure."""
    pending = {
        vb: committed.get(vb, VbOffset())
        for vb, o in latest.items()
        if o.seqno > committed.get(vb, VbOffset()).seqno
    }
    if not pending:
        return {}
    try:
        first_cas = asyncio.run(
            asyncio.wait_for(_first_cas(options, pending, latest), AGE_READ_TIMEOUT_S)
        )
    except Exception as error:  # the ages stay unknown; the items are still right
        log.warning("could not read the age of pending changes: %r", error)
        return {}
    return {vb: cas / 1e9 for vb, cas in first_cas.items()}


async def _first_cas(
    options: SourceOptions, pending: dict[int, VbOffset], latest: Offsets
) -> dict[int, int]:
    """vbucket -> CAS of its first change after ``pending[vb]`` (up to its latest seqno)."""
    config = client_config(
        options, f"changefeed:lag:{uuid.uuid4().hex}", rollback_to_snapshot=False
    )
    found: dict[int, int] = {}
    unfinished = set(pending)
    state = SessionState({vb: o.session(vb) for vb, o in pending.items()})
    async with dcp_client(options, config) as client:  # each vbucket from its active
        ends = {vb: min(latest[vb].seqno, o.seqno + AGE_WINDOW_SEQNOS) for vb, o in pending.items()}
        await client.stream(sorted(pending), state, end_seqnos=ends)
        async for event in client.events():
            if isinstance(event, Changes):
                columns = event.columns
                vbuckets = columns.array("vbucket")
                cas = columns.array("cas")
                for vb in np.unique(vbuckets).tolist():  # one step per vbucket present
                    if vb in unfinished:
                        found[vb] = int(cas[vbuckets == vb][0])  # the first is the oldest
                        unfinished.discard(vb)
            elif isinstance(event, Rollback | StreamEnded | StreamRefused):
                unfinished.discard(event.vbucket)
            if not unfinished:
                break
    return found
