"""The expiry pager on a real node: documents written with a short TTL reach DCP streams as
EXPIRATIONs although nobody reads them, and the pager's counters reach STAT and /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from changefeed.consumer import Changes, DcpClient
from changefeed.protocol.opcode import Opcode
from support.clients import HOST, dcp_config, free_port, kv_connect, raw_connection, stats
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(60)

VBUCKETS = 4
TTL_DOCUMENTS = 40
WAIT_S = 15.0  # TTL 1 s + pager passes every 0.2 s: the expirations come in ~1-2 s


async def http_metrics(port: int) -> str:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return raw.partition(b"\r\n\r\n")[2].decode()


def test_expirations_are_streamed_without_a_read(nodes: NodeFactory, tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text("expiry_pager_interval_s = 0.2\ncompaction_interval_s = 0\n")
    metrics_port = free_port()
    node = nodes(
        vbuckets=VBUCKETS, args=["--config", str(config), "--metrics-port", str(metrics_port)]
    )
    ttl_keys = {b"ttl-%03d" % i for i in range(TTL_DOCUMENTS)}
    kept_keys = {b"kept-%03d" % i for i in range(TTL_DOCUMENTS)}

    async def scenario() -> tuple[dict[bytes, int], float, dict[str, str], str]:
        client = DcpClient(dcp_config(node, to_latest=False))  # follows: no end seqno
        await client.connect()
        await client.stream(list(range(VBUCKETS)))
        async with await kv_connect(node) as kv:
            for key in sorted(ttl_keys):
                await kv.upsert(key, b"short-lived", expiry=1)  # seconds: relative
            for key in sorted(kept_keys):
                await kv.upsert(key, b"stays", expiry=3600)
        written = time.monotonic()
        expired: dict[bytes, int] = {}  # key -> opcode of its last change
        try:
            async with asyncio.timeout(WAIT_S):
                async for event in client.events():
                    if not isinstance(event, Changes):
                        continue
                    cols = event.columns
                    for key, opcode in zip(cols.key, cols.opcode, strict=True):
                        if opcode != Opcode.DCP_MUTATION:
                            expired[key] = opcode
                    if len(expired) >= len(ttl_keys):
                        break
        finally:
            await client.close()
        seconds = time.monotonic() - written
        conn = await raw_connection(node)
        try:
            general = await stats(conn, "")
        finally:
            await conn.close()
        return expired, seconds, general, await http_metrics(metrics_port)

    expired, seconds, general, metrics = asyncio.run(scenario())
    assert set(expired) == ttl_keys  # every short-lived document, and nothing else
    assert set(expired.values()) == {Opcode.DCP_EXPIRATION}
    assert seconds < WAIT_S
    assert int(general["expiry_pager_expired"]) == TTL_DOCUMENTS
    assert int(general["expiry_pager_runs"]) >= 1
    expired_total = re.search(r"^changefeed_expiry_pager_expired_total (\S+)$", metrics, re.M)
    assert expired_total is not None, metrics[:2000]
    assert float(expired_total.group(1)) == TTL_DOCUMENTS
    assert "expiry pager: expired" in node.log_text()
    assert node.errors_in_log() == []
    print(f"expirations of {TTL_DOCUMENTS} documents streamed {seconds:.2f} s after the writes")
