"""What a DCP consumer application sees, in order, per vbucket.

``Changes`` carries a run of items as columns (the hot path); the other events are rare control
events. A ``Rollback`` always precedes any data past its seqno (invariant 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from changefeed.protocol.batch import ChangeColumns
from changefeed.protocol.collections import SystemEventMessage
from changefeed.protocol.dcp import StreamEndReason


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """A stream request succeeded; ``failover_log`` replaces the consumer's."""

    vbucket: int
    failover_log: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Rollback:
    """Discard everything in ``vbucket`` after ``seqno``; the stream continues from there.

    ``server_seqno`` is the node's rollback point. ``seqno`` is at or below it: the newest point
    where this consumer held a whole snapshot (``ClientConfig.rollback_to_snapshot``), because
    data inside a deduplicated snapshot cannot be cut at an arbitrary seqno.
    """

    vbucket: int
    seqno: int
    server_seqno: int = -1


@dataclass(frozen=True, slots=True)
class Snapshot:
    vbucket: int
    snap_start: int
    snap_end: int
    flags: int
    purge_seqno: int = 0


@dataclass(frozen=True, slots=True)
class Changes:
    """Items of one or more vbuckets, in wire order (seqnos rise within each vbucket).

    ``columns`` holds numpy arrays and one bytes buffer (``ChangeColumns.array``, ``data``) for
    vectorised readers, and lists by field name (``columns.seqno``...) for item-by-item ones.
    """

    columns: ChangeColumns


@dataclass(frozen=True, slots=True)
class StreamEnded:
    vbucket: int
    reason: StreamEndReason


@dataclass(frozen=True, slots=True)
class StreamRefused:
    """The node refused the stream request (e.g. ERANGE; NOT_MY_VBUCKET once a client that
    follows the cluster map could not place the vbucket after its retries)."""

    vbucket: int
    status: int
    message: str


@dataclass(frozen=True, slots=True)
class Disconnected:
    """A connection to one node dropped (``reason`` names the node); the client reconnects,
    or follows the map to the vbuckets' new node, and resumes that connection's vbuckets from
    the session state."""

    reason: str


@dataclass(frozen=True, slots=True)
class CollectionEvent:
    """A collection or scope was created or dropped at ``message.seqno`` of ``vbucket`` (a
    DCP system event; only on a client that negotiated collections). Its seqno is part of the
    stream: changes of a dropped collection stop before it, a created one's start after."""

    vbucket: int
    message: SystemEventMessage


@dataclass(frozen=True, slots=True)
class SeqnoAdvanced:
    """``vbucket``'s stream moved to ``seqno`` over changes it does not carry (other
    collections): the position to resume from, and the end of a snapshot seen whole."""

    vbucket: int
    seqno: int


Event = (
    StreamOpened
    | Rollback
    | Snapshot
    | Changes
    | StreamEnded
    | StreamRefused
    | Disconnected
    | CollectionEvent
    | SeqnoAdvanced
)
