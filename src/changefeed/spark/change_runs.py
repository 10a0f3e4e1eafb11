"""Decoded changes gathered across receive buffers, so Arrow rows are built in large runs.

Each ``Changes`` event holds the changes of one receive buffer (about a thousand on a busy
backfill), and building Arrow rows has a fixed cost per call (some 40 array operations:
``consumer/change_rows.py``). Measured on 200k mutations of 100 bytes: 0.49 µs per change
built a thousand at a time, 0.20 at 8,000, 0.15 at 64,000. ``PendingChanges`` holds the
events' ``ChangeColumns`` until ``rows_max`` changes (or ``bytes_max`` bytes) are there, then
``take`` joins them into one (``concat_columns``: numpy concatenations and one bytes join).

The read (``reading.py``) must give each change the snapshot and end seqno of its vbucket as
of its arrival, so it takes the pending changes first whenever an event changes those for a
vbucket that has pending changes (``holds``), and before a rollback row (rows keep wire
order). Whether a vbucket has reached its end is still asked of every event as it comes
(``EndSeqnos.reached``): the read stops as soon as every vbucket has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from changefeed import limits
from changefeed.protocol.batch import FIELD_DTYPES, OFFSET_NAMES, ChangeColumns

VBUCKETS_MAX: Final = 1 << 16  # vbucket ids are u16 on the wire
BYTES_MAX: Final = 64 * 1024 * 1024  # a run's data: 64k changes of 1 KiB; held twice while joined


def concat_columns(parts: Sequence[ChangeColumns]) -> ChangeColumns:
    """The changes of ``parts``, in order, as one ``ChangeColumns`` (offsets shifted into the
    joined data)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return ChangeColumns()
    if len(parts) == 1:
        return parts[0]
    columns: dict[str, Any] = {
        name: np.concatenate([p.array(name) for p in parts]) for name in FIELD_DTYPES
    }
    shifts = np.cumsum([0] + [len(p.data) for p in parts[:-1]], dtype=np.int64)
    for name in OFFSET_NAMES:
        columns[name] = np.concatenate(
            [p.array(name) + shift for p, shift in zip(parts, shifts.tolist(), strict=True)]
        )
    return ChangeColumns(columns, b"".join(p.data for p in parts))


class EndSeqnos:
    """Each vbucket's end seqno as a lookup table: which vbuckets a run of changes reached,
    without a Python step per change."""

    def __init__(self, ends: Mapping[int, int]) -> None:
        self._ends = np.full(VBUCKETS_MAX, limits.SEQNO_MAX, np.uint64)
        for vbucket, seqno in ends.items():
            self.put(vbucket, seqno)

    def put(self, vbucket: int, seqno: int) -> None:
        self._ends[vbucket] = seqno

    def reached(self, columns: ChangeColumns) -> set[int]:
        """The vbuckets with a change in ``columns`` at or past their end seqno."""
        if not len(columns):
            return set()
        vbuckets = columns.array("vbucket")
        hit = columns.array("seqno") >= self._ends[vbuckets]
        if not bool(hit.any()):
            return set()
        found: list[int] = np.unique(vbuckets[hit]).tolist()
        return set(found)


class PendingChanges:
    """``ChangeColumns`` held until enough are there to build rows from (module docstring)."""

    def __init__(self, rows_max: int = limits.ROWS_PER_BATCH_MAX, bytes_max: int = BYTES_MAX):
        assert rows_max > 0 and bytes_max > 0, (rows_max, bytes_max)
        self.rows_max = rows_max
        self.bytes_max = bytes_max
        self._parts: list[ChangeColumns] = []
        self._rows = 0
        self._bytes = 0
        self._held: NDArray[np.bool_] = np.zeros(VBUCKETS_MAX, np.bool_)

    def __len__(self) -> int:
        return self._rows

    def add(self, columns: ChangeColumns) -> None:
        if len(columns):
            self._parts.append(columns)
            self._rows += len(columns)
            self._bytes += len(columns.data)
            self._held[columns.array("vbucket")] = True

    @property
    def full(self) -> bool:
        return self._rows >= self.rows_max or self._bytes >= self.bytes_max

    def holds(self, vbucket: int) -> bool:
        """Whether a change of ``vbucket`` is pending."""
        return bool(self._held[vbucket])

    def take(self) -> ChangeColumns:
        """The pending changes as one ``ChangeColumns``, in arrival order; none are left."""
        taken = concat_columns(self._parts)
        for part in self._parts:
            self._held[part.array("vbucket")] = False
        self._parts, self._rows, self._bytes = [], 0, 0
        return taken
