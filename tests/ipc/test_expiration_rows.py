"""An expired document's row from the ring says ``op = expiration``, as a `DcpClient` (which asks
for the expiry opcode) and `LocalStream`'s own DCP fallback say. The publisher used to frame
its in-process stream without the expiry opcode and decode the frames back, so the ring said
``deletion`` for the same change."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from changefeed.consumer import ClientConfig, KvClient
from changefeed.ipc.local_stream import high_seqnos
from ipc.test_node_wiring import dcp_rows, open_streams, read_until, shm_node
from support.nodes import NodeFactory


def test_an_expiration_is_an_expiration_row(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path)
    streams = open_streams(node.port, ipc_dir)  # from now: before the first write

    async def run() -> set[tuple[int, int, str, str, bytes]]:
        async with await KvClient.connect("127.0.0.1", node.port) as kv:
            for i in range(8):
                await kv.upsert(b"stays-%d" % i, b"v")
                await kv.upsert(b"expires-%d" % i, b"v", expiry=1)
            await kv.remove(b"stays-0")
            await asyncio.sleep(2.2)
            for i in range(8):  # a read of an expired document expires it (lazy expiry)
                with contextlib.suppress(Exception):
                    await kv.get(b"expires-%d" % i)
        ends = await high_seqnos(ClientConfig(port=node.port))
        return await read_until(streams, ends)

    try:
        rows = asyncio.run(run())
    finally:
        for local in streams:
            local.close()
    reference = asyncio.run(dcp_rows(node.port))  # from 0: each key's newest change
    assert reference <= rows  # the ring has every change, the reference the newest of each
    ops = {key: op for _, _, key, op, _ in rows if key.startswith("expires-") and op != "mutation"}
    assert ops == {f"expires-{i}": "expiration" for i in range(8)}
    assert "deletion" in {op for _, _, key, op, _ in rows if key == "stays-0"}
