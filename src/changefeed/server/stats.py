"""What a node reports: STAT groups and the cluster map of GET_CLUSTER_CONFIG.

Both read the `ServerContext` only; each DCP connection reports its own counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from changefeed.server.context import ServerContext


def stat_group(context: ServerContext, group: str) -> Iterator[tuple[str, str]]:
    """STAT groups: "" (general), "vbucket-seqno [vb]", "failovers [vb]", "dcp",
    "replication [vb]" (the replicas of this node's active vbuckets)."""
    parts = group.split()
    name = parts[0] if parts else ""
    vbs = [int(parts[1])] if len(parts) > 1 and parts[1].isdigit() else None
    bucket = context.bucket
    if name == "":
        yield "curr_connections", str(len(context.connections))
        yield "curr_items", str(bucket.item_count())
        for state, count in bucket.state_counts().items():
            yield f"vb_{state.value}_num", str(count)
        yield "checkpoint_memory_bytes", str(bucket.checkpoint_memory_bytes())
        yield "dcp_backfills_started", str(context.backfill_slots.taken_total)
        yield "dcp_streams_ended_state_changed", str(context.dcp.streams_ended_state_changed)
        if context.catchup_rate is not None:
            yield "replication_catchup_bytes", str(context.catchup_rate.spent_total)
        yield "persistence_failing", "1" if bucket.persistence.failing else "0"
        yield "persistence_failures_total", str(bucket.persistence.failures_total)
        yield "persistence_error", bucket.persistence.error or ""
        yield "persistence_waits", str(bucket.persistence_waits.count)
        yield "persistence_waits_answered", str(bucket.persistence_waits.answered_total)
        yield "persistence_waits_requested", str(bucket.persistence_waits.requested_total)
        for worker in (context.compactor, context.expiry_pager):
            if worker is not None:  # compaction_* and expiry_pager_* counters
                yield from worker.stats()
    elif name == "vbucket-seqno":
        yield from bucket.seqno_stats(vbs)
    elif name == "failovers":
        yield from bucket.failover_stats(vbs)
    elif name == "dcp":
        yield from context.dcp.stats()
    elif name in context.stat_providers:
        yield from context.stat_providers[name]()
    elif name == "replication" and context.replication is not None:
        for counter, value in context.replication.counters().items():
            yield counter, f"{value:g}"
        for r in context.replication.snapshot():
            if vbs is None or r.vb in vbs:
                prefix = f"vb_{r.vb}:replica:{r.replica}"
                yield f"{prefix}:acked_seqno", str(r.received_seqno)
                yield f"{prefix}:persisted_seqno", str(r.persisted_seqno)
                yield f"{prefix}:lag_items", str(r.lag_items)
                yield f"{prefix}:lag_s", f"{r.lag_s:.3f}"
                yield f"{prefix}:in_sync", "1" if r.in_sync else "0"
                yield f"{prefix}:connected", "1" if r.connected else "0"
