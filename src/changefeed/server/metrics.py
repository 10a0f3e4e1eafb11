"""Prometheus metrics of a node, in the text format operators scrape (``/metrics``).

Gauges are read at scrape time from the node (a collector), so the hot paths pay nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from changefeed.server.admission import COUNTER_HELP as ADMISSION_HELP
from changefeed.server.admission import Admission
from changefeed.server.context import ServerContext


class NodeCollector(Collector):
    def __init__(self, context: ServerContext) -> None:
        self._context = context

    def collect(self) -> Iterator[Metric]:
        context = self._context
        bucket = context.bucket
        yield _gauge("changefeed_connections", "Open client connections.", len(context.connections))
        yield _gauge("changefeed_dcp_streams", "Active DCP streams.", context.dcp.streams_total())
        yield _gauge("changefeed_items", "Live items in the bucket.", bucket.item_count())
        yield _gauge(
            "changefeed_checkpoint_memory_bytes",
            "Bytes held by checkpoints (all vbuckets).",
            bucket.checkpoint_memory_bytes(),
        )
        yield _gauge(
            "changefeed_persistence_failing",
            "1 while flush commits fail (writes are refused with TMPFAIL).",
            int(bucket.persistence.failing),
        )
        yield _gauge(
            "changefeed_persistence_failures_total",
            "Flush commits that failed since start.",
            bucket.persistence.failures_total,
        )
        yield _gauge(
            "changefeed_persistence_waits",
            "SEQNO_PERSISTENCE requests waiting for their seqno to be persisted.",
            bucket.persistence_waits.count,
        )
        yield _gauge(
            "changefeed_persistence_waits_answered_total",
            "SEQNO_PERSISTENCE requests answered once their seqno was persisted.",
            bucket.persistence_waits.answered_total,
        )
        yield _gauge(
            "changefeed_persistence_waits_requested_total",
            "SEQNO_PERSISTENCE requests, those answered at once (already persisted) included.",
            bucket.persistence_waits.requested_total,
        )
        yield from _background_gauges(context)
        yield from _replication_gauges(context)
        for provider in context.metric_providers:
            yield from provider()
        for name, help_text, read in _per_vb_gauges():
            family = GaugeMetricFamily(name, help_text, labels=["vbucket"])
            for vb in bucket.vbucket_ids():
                family.add_metric([str(vb)], read(bucket, vb))
            yield family
        lag = GaugeMetricFamily(
            "changefeed_dcp_cursor_lag_items",
            "Seqnos a DCP stream is behind the vbucket's high seqno.",
            labels=["connection", "vbucket"],
        )
        for name, vb, behind in context.dcp.lags():
            lag.add_metric([name, str(vb)], behind)
        yield lag


def admission_gauges(admission: Admission) -> Iterator[GaugeMetricFamily]:
    """The connection budgets (server/admission.py): ``changefeed_connections_<name>`` for
    each of ``Admission.counters`` (the node adds this to ``ServerContext.metric_providers``)."""
    for key, value in admission.counters().items():
        yield _gauge(f"changefeed_connections_{key}", ADMISSION_HELP[key], value)


def _background_gauges(context: ServerContext) -> Iterator[GaugeMetricFamily]:
    """Counters of compaction and of the expiry pager since the node started."""
    workers = (
        ("compaction", context.compactor),
        ("expiry_pager", context.expiry_pager),
    )
    for prefix, worker in workers:
        if worker is None:
            continue
        for key, value in worker.counters.items():
            yield _gauge(f"changefeed_{prefix}_{key}_total", worker.COUNTER_HELP[key], value)
        yield _gauge(
            f"changefeed_{prefix}_last_run_seconds",
            f"Duration of the last {prefix.replace('_', ' ')} run.",
            worker.last_run_s,
        )


def _replication_gauges(context: ServerContext) -> Iterator[GaugeMetricFamily]:
    """The active side of replication: per (vbucket, replica) lag and in-sync membership, and
    node totals of catch-ups and of bytes sent to catching-up replicas."""
    tracker = context.replication
    if tracker is None:
        return
    for key, value in tracker.counters().items():
        yield _gauge(f"changefeed_{key}", _REPLICATION_HELP[key], value)
    if context.catchup_rate is not None:
        yield _gauge(
            "changefeed_replication_catchup_bytes_total",
            "Bytes sent from disk to catching-up replicas (the rate-limited part).",
            context.catchup_rate.spent_total,
        )
    labels = ["vbucket", "replica"]
    lag_items = GaugeMetricFamily(
        "changefeed_replica_lag_items",
        "Active high seqno minus the replica's acked.",
        labels=labels,
    )
    lag_s = GaugeMetricFamily(
        "changefeed_replica_lag_seconds", "Seconds since the replica was caught up.", labels=labels
    )
    in_sync = GaugeMetricFamily(
        "changefeed_replica_in_sync", "1 while the replica is in the in-sync set.", labels=labels
    )
    for r in tracker.snapshot():
        label_values = [str(r.vb), r.replica]
        lag_items.add_metric(label_values, r.lag_items)
        lag_s.add_metric(label_values, r.lag_s)
        in_sync.add_metric(label_values, 1.0 if r.in_sync else 0.0)
    yield lag_items
    yield lag_s
    yield in_sync


_REPLICATION_HELP = {
    "replication_catchups_started": "Replica catch-ups started (a stream opened behind).",
    "replication_catchups_finished": "Replica catch-ups finished (the replica reached the end).",
    "replication_catchup_seconds_last": "Duration of the last finished catch-up.",
    "replication_items_acked": "Items replicas acknowledged (seqno distance).",
    "replication_streams": "Replica streams open now.",
}


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _per_vb_gauges() -> list[tuple[str, str, Callable[..., float]]]:
    return [
        ("changefeed_high_seqno", "High seqno per vbucket.", lambda b, vb: b.seqnos(vb)[0]),
        (
            "changefeed_persisted_seqno",
            "Persisted seqno per vbucket.",
            lambda b, vb: b.seqnos(vb)[1],
        ),
        ("changefeed_purge_seqno", "Purge seqno per vbucket.", lambda b, vb: b.seqnos(vb)[2]),
    ]


async def serve_metrics(context: ServerContext, host: str, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` on the node's event loop (so collection never races the loop)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(context))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10.0)
            while (await asyncio.wait_for(reader.readline(), 10.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers: bounded by the stream limit and the deadline
            if request_line.split()[1:2] == [b"/metrics"]:
                body, status = generate_latest(registry), b"200 OK"
            else:
                body, status = b"not found; try /metrics\n", b"404 Not Found"
            writer.write(
                b"HTTP/1.0 "
                + status
                + b"\r\nContent-Type: "
                + CONTENT_TYPE_LATEST.encode()
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
        except (OSError, TimeoutError, asyncio.LimitOverrunError, ValueError):
            pass  # a broken scrape only affects that scrape
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=16 * 1024)
