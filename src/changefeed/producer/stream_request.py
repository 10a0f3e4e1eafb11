"""Deciding a DCP_STREAM_REQ: refuse, roll back, or accept — in the reference's order.

Pure: the caller passes what it knows about the vbucket and the connection; nothing here touches
a socket or a vbucket. The order of checks is dcp-wire.md §6.2 (DcpProducer::streamRequest), so
a client sees the same status for the same mistake as against Couchbase.
"""

from __future__ import annotations

from dataclasses import dataclass

from changefeed.failover import FailoverLog
from changefeed.protocol.dcp import StreamFlag, StreamRequest
from changefeed.protocol.status import Status
from changefeed.vbucket_state import VBucketState


@dataclass(frozen=True, slots=True)
class VbucketView:
    """What the decision needs to know about the vbucket at request time."""

    state: VBucketState
    high_seqno: int
    persisted_seqno: int
    purge_seqno: int
    failover_log: FailoverLog


@dataclass(frozen=True, slots=True)
class Refused:
    status: Status
    message: str


@dataclass(frozen=True, slots=True)
class RollbackTo:
    seqno: int
    reason: str


@dataclass(frozen=True, slots=True)
class Accepted:
    """The stream to run: send ``(start_seqno, end_seqno]`` starting with a marker at start.

    ``failover_log`` is the vbucket's log at acceptance, the body of the success response.
    """

    start_seqno: int
    end_seqno: int
    snap_start: int
    snap_end: int
    vb_uuid: int
    failover_log: tuple[tuple[int, int], ...]


def decide_stream_request(
    request: StreamRequest,
    vb: VbucketView | None,
    *,
    stream_exists: bool,
    stream_ids_enabled: bool = False,
) -> Accepted | RollbackTo | Refused:
    """Apply §6.2 checks 1–9 and the rollback rules (§9) to ``request``."""
    flags = request.flags
    if vb is None or not vb.state.streamable:
        return Refused(Status.NOT_MY_VBUCKET, f"vbucket {request.vbucket} is not served here")
    if flags & StreamFlag.ACTIVE_VB_ONLY and vb.state is not VBucketState.ACTIVE:
        return Refused(Status.NOT_MY_VBUCKET, f"vbucket {request.vbucket} is {vb.state}")
    start, end = request.start_seqno, request.end_seqno
    snap_start, snap_end, uuid = request.snap_start, request.snap_end, request.vb_uuid
    if flags & StreamFlag.FROM_LATEST:
        start = snap_start = snap_end = vb.high_seqno
        uuid = uuid or vb.failover_log.latest[0]
    if start > end:
        return Refused(Status.ERANGE, f"start {start} > end {end}")
    if not snap_start <= start <= snap_end:
        return Refused(
            Status.ERANGE, f"need snap_start {snap_start} <= start {start} <= {snap_end}"
        )
    if stream_ids_enabled != (request.stream_id is not None):
        return Refused(Status.DCP_STREAM_ID_INVALID, "stream id present iff enable_stream_id")
    if stream_exists:
        return Refused(Status.KEY_EEXISTS, f"a stream for vbucket {request.vbucket} exists")
    decision = vb.failover_log.needs_rollback(
        start,
        uuid,
        snap_start,
        snap_end,
        vb.high_seqno,
        vb.purge_seqno,
        strict_vb_uuid=bool(flags & StreamFlag.STRICT_VB_UUID),
        client_purge_seqno=request.client_purge_seqno,
        ignore_purged_tombstones=bool(flags & StreamFlag.IGNORE_PURGED_TOMBSTONES),
    )
    if decision.rollback:
        return RollbackTo(decision.seqno, decision.reason.name)
    if flags & StreamFlag.TO_LATEST:
        end = vb.high_seqno
    elif flags & StreamFlag.DISK_ONLY:
        end = vb.persisted_seqno
    if start > end and flags & (StreamFlag.TO_LATEST | StreamFlag.DISK_ONLY):
        return Refused(Status.ERANGE, f"start {start} is past the end {end}")
    if start > vb.high_seqno:
        return Refused(Status.ERANGE, f"start {start} > high seqno {vb.high_seqno}")
    if start == snap_start and snap_end > vb.high_seqno:
        snap_end = start  # §6.2 step 9: clamp rather than fail
    log = vb.failover_log
    return Accepted(start, end, snap_start, snap_end, log.latest[0], tuple(log.entries))
