"""STAT groups over the memcached protocol and Prometheus ``/metrics`` over HTTP."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from changefeed.consumer import DcpClient
from support.clients import HOST, dcp_config, free_port, kv_connect, raw_connection, stats
from support.consumer import StreamedState, drain
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)

METRIC_LINE = re.compile(r'^changefeed_high_seqno\{vbucket="(\d+)"\} (\S+)$', re.MULTILINE)


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, body.decode()


def test_stats_and_metrics(nodes: NodeFactory) -> None:
    metrics_port = free_port()
    node = nodes(vbuckets=4, args=["--metrics-port", str(metrics_port)])

    async def scenario() -> None:
        async with await kv_connect(node) as kv:
            results = await kv.upsert_many(
                [(b"key-%d" % i, b"v") for i in range(400)], durability="persist"
            )
            await kv.remove(b"key-7")
        written: dict[int, int] = {}
        for r in results:
            written[r.vbucket] = max(written.get(r.vbucket, 0), r.seqno)

        conn = await raw_connection(node)
        try:
            seqnos = await stats(conn, "vbucket-seqno")
            one = await stats(conn, "vbucket-seqno 2")
            general = await stats(conn, "")
            failovers = await stats(conn, "failovers")
        finally:
            await conn.close()
        for vb in range(4):
            high = int(seqnos[f"vb_{vb}:high_seqno"])
            assert high >= written[vb], (vb, high, written[vb])
            assert int(seqnos[f"vb_{vb}:last_persisted_seqno"]) >= written[vb]
            assert int(seqnos[f"vb_{vb}:uuid"]) > 0
            assert int(failovers[f"vb_{vb}:num_entries"]) >= 1
            assert failovers[f"vb_{vb}:0:id"] == seqnos[f"vb_{vb}:uuid"]
        assert sum(int(seqnos[f"vb_{vb}:high_seqno"]) for vb in range(4)) == 401
        assert set(one) == {k for k in seqnos if k.startswith("vb_2:")}, one
        assert int(general["curr_connections"]) >= 1
        assert int(general["vb_active_num"]) == 4

        # /metrics while a DCP stream is open: per-vb high seqnos equal the STAT answer.
        client = DcpClient(dcp_config(node, to_latest=False))
        await client.connect()
        await client.stream([0, 1])
        streamed = StreamedState()
        await drain(client, streamed, lambda c, m: {0, 1} <= m.opened, timeout_s=10)
        status, body = await http_get(metrics_port, "/metrics")
        assert status == 200, body[:200]
        highs = {int(vb): float(v) for vb, v in METRIC_LINE.findall(body)}
        assert highs == {vb: float(seqnos[f"vb_{vb}:high_seqno"]) for vb in range(4)}, highs
        assert re.search(r"^changefeed_dcp_streams 2\.0$", body, re.MULTILINE), body
        assert "changefeed_checkpoint_memory_bytes" in body
        assert "# TYPE changefeed_high_seqno gauge" in body
        await client.close()
        status, _ = await http_get(metrics_port, "/nothing")
        assert status == 404

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_shared_memory_figures_in_stat_shm_and_metrics(nodes: NodeFactory, tmp_path: Path) -> None:
    """Issue 27 item 4: a node with --shm serves its services' figures as STAT ``shm`` and as
    ``changefeed_shm_*`` families on /metrics (they were built but not served)."""
    metrics_port = free_port()
    node = nodes(
        vbuckets=4,
        args=[
            "--shm",
            "1",
            "--shm-dir",
            str(tmp_path / "shm"),
            "--metrics-port",
            str(metrics_port),
        ],
    )

    async def scenario() -> None:
        conn = await raw_connection(node)
        try:
            figures = await stats(conn, "shm")
        finally:
            await conn.close()
        services = {key.split(":")[0] for key in figures}
        assert len(services) == 1, figures
        assert any(key.endswith(":rows_published") or "published" in key for key in figures)
        status, body = await http_get(metrics_port, "/metrics")
        assert status == 200
        assert "changefeed_shm_" in body

    asyncio.run(scenario())
