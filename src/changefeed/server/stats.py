"""What a node reports: STAT groups and the cluster map of GET_CLUSTER_CONFIG.

Both read the `ServerContext` only; each DCP connection reports its own counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from changefeed.server.context import ServerContext


def stat_group(context: ServerContext, group: str) -> Iterator[tuple[str, str]]:
    """STAT groups: "" (general), "vbucket-seqno [vb]", "failovers [vb]", "dcp"."""
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
        yield "persistence_failing", "1" if bucket.persistence.failing else "0"
        yield "persistence_failures_total", str(bucket.persistence.failures_total)
        yield "persistence_error", bucket.persistence.error or ""
        for worker in (context.compactor, context.expiry_pager):
            if worker is not None:  # compaction_* and expiry_pager_* counters
                yield from worker.stats()
    elif name == "vbucket-seqno":
        yield from bucket.seqno_stats(vbs)
    elif name == "failovers":
        yield from bucket.failover_stats(vbs)
    elif name == "dcp":
        yield from context.dcp.stats()


def cluster_config(context: ServerContext) -> dict[str, object]:
    """A Couchbase-style cluster map for this single node (every vbucket active here)."""
    host = context.config.host
    server = f"{host}:{context.port}"
    return {
        "rev": 1,
        "name": context.bucket.name,
        "nodeLocator": "vbucket",
        "nodes": [{"hostname": f"{host}:8091", "ports": {"direct": context.port}}],
        "nodesExt": [{"hostname": host, "services": {"kv": context.port}}],
        "vBucketServerMap": {
            "hashAlgorithm": "CRC",
            "numReplicas": 0,
            "serverList": [server],
            "vBucketMap": [[0] for _ in range(context.config.vbuckets)],
        },
    }
