"""What a service looks like now: its ring's slots by state, its readers, its age and size.

Read from the shared words alone (one load each; no lock, nothing written), so the provider
(`Provider.service_stats`, STAT ``shm`` and ``/metrics`` on a node) and any process on the host
(`inspect`, ``python -m changefeed.ipc.stats``) see the same figures. A snapshot, not a
transaction: words change while they are read, so counts may be off by the one batch being
published or referenced meanwhile.

Figures (docs/ipc.md, "How to watch it"):

    slots_empty / slots_in_writing / slots_ready / slots_referenced
        the ring's slots by state (ready: holds a batch no reader references).
    readers_attached       registered readers with a committed subscription.
    readers_stalled        attached readers whose next batch waits in the ring for over
                           STALLED_AGE_S (alive or not: a dead one stalls until reclaimed).
    readers_behind         attached readers whose next batch is no longer in the ring: their
                           next read raises LostDataError (a LocalStream catches up over DCP).
    readers_dead           logs owned by a process that is gone and not yet reclaimed.
    logs_quarantined       logs marked needs-rollback (caught mid-transaction).
    readers_lost_total     times the attached readers fell behind the ring (LostDataError).
    oldest_unread_age_s    age of the oldest batch an attached reader has yet to take (0: all
                           caught up).
    head_seq               the newest batch's seq (batches published into these segments).
    bytes_mapped           control + data segment bytes.
"""

from __future__ import annotations

import struct
import sys
import time
from typing import Final

from changefeed.ipc.atomic import Atomics, atomics_for
from changefeed.ipc.layout import (
    HEAD_SEQ_AT,
    INVALID_OWNER,
    NODE_LOST,
    NODE_NEEDS_ROLLBACK,
    NODE_NEXT_SEQ,
    NODE_SUB_BEGIN,
    NODE_SUB_END,
    REFCOUNT_BITS,
    REFCOUNT_MASK,
    SEQ_IN_WRITING,
    ControlLayout,
    check_control,
)
from changefeed.ipc.segments import Segment, ServicePaths
from changefeed.ipc.txlog import Liveness, TransactionLogSet, is_alive

STALLED_AGE_S: Final = 1.0  # a reader whose next batch waits longer than this is stalled
_PUBLISHED_NS: Final = struct.Struct("<Q")
_PUBLISHED_NS_AT: Final = 32  # in a slot's header (layout.SLOT_HEADER: seq, ..., published_ns)

FIGURES: Final = (
    "slots_empty",
    "slots_in_writing",
    "slots_ready",
    "slots_referenced",
    "readers_attached",
    "readers_stalled",
    "readers_behind",
    "readers_dead",
    "logs_quarantined",
    "readers_lost_total",
    "oldest_unread_age_s",
    "head_seq",
    "bytes_mapped",
)


def service_stats(
    a: Atomics,
    layout: ControlLayout,
    data: memoryview,
    *,
    alive: Liveness = is_alive,
    now_ns: int | None = None,
) -> dict[str, float]:
    """The figures of one service (see the module docstring), from its mapped segments."""
    geometry = layout.geometry
    now_ns = time.time_ns() if now_ns is None else now_ns
    figures: dict[str, float] = dict.fromkeys(FIGURES, 0)
    published: dict[int, int] = {}  # seq -> published_ns, of the batches in the ring
    for slot in range(geometry.slot_count):
        word = a.load_u64(layout.slot_state(slot))
        seq, refs = word >> REFCOUNT_BITS, word & REFCOUNT_MASK
        if seq == 0:
            figures["slots_empty"] += 1
        elif seq == SEQ_IN_WRITING:
            figures["slots_in_writing"] += 1
        else:
            figures["slots_referenced" if refs else "slots_ready"] += 1
            (stamp,) = _PUBLISHED_NS.unpack_from(
                data, slot * geometry.slot_bytes + _PUBLISHED_NS_AT
            )
            # Acquire fence, paired with the release fence after the provider's IN_WRITING CAS
            # (ring.claim_slot): the read above happens before the validating load.
            a.fence_acquire()
            if a.load_u64(layout.slot_state(slot)) >> REFCOUNT_BITS == seq:  # still that batch
                published[seq] = stamp
    head = a.load_u64(HEAD_SEQ_AT)
    logs = TransactionLogSet(a, layout)
    oldest_unread_ns = now_ns
    for index in range(geometry.max_subscribers):
        node = layout.node(index)
        if a.load_u32(node) == INVALID_OWNER:
            continue
        process = logs.owner_process(index)
        gone = bool(process.pid) and not alive(process)
        if a.load_u8(node + NODE_NEEDS_ROLLBACK):
            figures["logs_quarantined"] += 1
        elif gone:
            figures["readers_dead"] += 1
        if (a.load_u8(node + NODE_SUB_BEGIN), a.load_u8(node + NODE_SUB_END)) != (1, 1):
            continue
        figures["readers_attached"] += 1
        figures["readers_lost_total"] += a.load_u64(node + NODE_LOST)
        next_seq = a.load_u64(node + NODE_NEXT_SEQ)
        if next_seq > head:
            continue  # caught up
        stamp = published.get(next_seq)
        if stamp is None:  # published (<= head) and gone: overwritten
            figures["readers_behind"] += 1
            continue
        oldest_unread_ns = min(oldest_unread_ns, stamp)
        if now_ns - stamp > STALLED_AGE_S * 1e9:
            figures["readers_stalled"] += 1
    figures["oldest_unread_age_s"] = max(0.0, (now_ns - oldest_unread_ns) / 1e9)
    figures["head_seq"] = head
    figures["bytes_mapped"] = layout.control_bytes + geometry.data_bytes
    assert sum(figures[f"slots_{s}"] for s in ("empty", "in_writing", "ready", "referenced")) == (
        geometry.slot_count
    ), figures
    return figures


def inspect(service: str, directory: str | None = None) -> dict[str, float]:
    """The figures of `service` as any process on the host sees them (maps its segments,
    reads, unmaps; takes no lock and registers nothing).

    Raises:
        ServiceNotFoundError: no such service in `directory`.
        ControlSegmentError: its control segment does not decode.
    """
    paths = ServicePaths(service, directory)
    control = Segment.open(paths.control_segment, service)
    try:
        header = check_control(control.buf)
        data = Segment.open(paths.data_segment, service)
        try:
            a = atomics_for(control.buf)
            try:
                return service_stats(a, header.layout, data.buf)
            finally:
                a.close()
        finally:
            data.close()
    finally:
        control.close()


def main(argv: list[str]) -> int:
    """``python -m changefeed.ipc.stats SERVICE [DIRECTORY]``: print the figures."""
    if not 1 <= len(argv) <= 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    for name, value in inspect(argv[0], argv[1] if len(argv) > 1 else None).items():
        print(f"{name:24} {value:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
