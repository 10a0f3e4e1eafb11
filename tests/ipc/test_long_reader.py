"""A local reader that has run a while, against a real node (issue 27, item 1).

Before the fix every shared-memory batch added a consistent point to the reader's session with
no bound; after ~90 the first fallback to TCP raised AssertionError, and the saved state made
every restart raise again. Here a reader takes thousands of batches, is forced behind the ring
(so it catches up over DCP), saves its state, and a new reader resumes from that state: every
change arrives exactly once, and the state stays within its bound throughout.
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path

import pyarrow as pa

from changefeed.consumer import ClientConfig, KvClient
from changefeed.consumer.session import CONSISTENT_POINTS_MAX, SessionState
from changefeed.ipc.local_stream import LocalStream, high_seqnos, services_of
from ipc.test_node_wiring import VBUCKETS, dcp_rows, load, shm_node
from support.nodes import NodeFactory

Key = tuple[int, int, str]
BATCHES_MIN = 1000  # the old build crashed after ~90 batches per vbucket


def keys_of(batch: pa.RecordBatch) -> list[Key]:
    columns = [batch.column(name).to_pylist() for name in ("vbucket", "seqno", "key", "op")]
    return [
        (vb, seqno, key) for vb, seqno, key, op in zip(*columns, strict=True) if op != "rollback"
    ]


def bounded(streams: list[LocalStream]) -> None:
    for local in streams:
        assert local.session is not None
        for session in local.session.vbuckets.values():
            session.check_invariants()
            assert len(session.consistent_points) <= CONSISTENT_POINTS_MAX


async def read_to(streams: list[LocalStream], ends: dict[int, int], got: list[Key]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60.0
    while not all(
        local.session is not None and local.session.get(vb).seqno >= ends.get(vb, 0)
        for local in streams
        for vb in local.group
    ):
        assert loop.time() < deadline, [local.stats for local in streams]
        for local in streams:
            batch = await local.next_batch(0.01)
            if batch is not None:
                got.extend(keys_of(batch))
        bounded(streams)


async def trickle(port: int, prefix: str, done: asyncio.Event) -> int:
    """One write at a time until `done` (publishing not held for persistence: a batch every
    few writes); returns how many were written."""
    written = 0
    async with await KvClient.connect("127.0.0.1", port) as kv:
        while not done.is_set():
            await kv.upsert(f"{prefix}{written}".encode(), b"v" * 20)
            written += 1
    return written


def test_a_reader_through_thousands_of_batches_falls_back_to_tcp_and_restarts(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(
        nodes, ipc_dir, tmp_path, shm_slots=8, shm_max_subscribers=3, shm_persisted_only="false"
    )
    state_file = tmp_path / "reader-state.json"

    async def main() -> int:
        trickled = 0
        config = ClientConfig(port=node.port)
        services = services_of("default", node.port, ipc_dir)
        streams = [
            LocalStream(s, directory=ipc_dir, app_id=1, dcp=config, start="beginning")
            for s in services
        ]
        got: list[Key] = []
        try:
            # 1. thousands of ring batches while a writer trickles changes in
            done = asyncio.Event()
            writer = asyncio.create_task(trickle(node.port, "t", done))
            deadline = asyncio.get_running_loop().time() + 120
            while sum(local.stats["shm_batches"] for local in streams) < BATCHES_MIN:
                assert asyncio.get_running_loop().time() < deadline, [s.stats for s in streams]
                for local in streams:
                    batch = await local.next_batch(0.002)
                    if batch is not None:
                        got.extend(keys_of(batch))
                bounded(streams)
            done.set()
            trickled = await writer
            await read_to(streams, await high_seqnos(config), got)
            batches = sum(local.stats["shm_batches"] for local in streams)
            assert batches >= BATCHES_MIN, [local.stats for local in streams]
            # 2. forced behind the ring: more batches than its 8 slots while it does not read
            for i in range(24):
                await load(node.port, 20, prefix=f"p{i}-", durability="persist")
            lost_before = sum(local.stats["lost"] for local in streams)
            dcp_before = sum(local.stats["dcp_rows"] for local in streams)
            await read_to(streams, await high_seqnos(config), got)
            assert sum(local.stats["lost"] for local in streams) > lost_before
            assert sum(local.stats["dcp_rows"] for local in streams) > dcp_before
            # 3. the state, saved as `changefeed stream --state` saves it
            saved = SessionState()
            for local in streams:
                assert local.session is not None
                for vb in local.group:
                    saved.vbuckets[vb] = local.session.get(vb).copy()
            state_file.write_text(saved.to_json())
        finally:
            for local in streams:
                local.close()
        await load(node.port, 500, prefix="after")  # while no reader runs
        resumed = SessionState.from_json(state_file.read_text())
        streams = [
            LocalStream(s, directory=ipc_dir, app_id=1, dcp=config, start=resumed) for s in services
        ]
        try:
            await load(node.port, 300, prefix="live")  # and while it runs
            await read_to(streams, await high_seqnos(config), got)
            assert len(state_file.read_text()) < 2000 * VBUCKETS
        finally:
            for local in streams:
                local.close()
        reference = collections.Counter(
            (vb, seqno, key) for vb, seqno, key, _, _ in await dcp_rows(node.port)
        )
        counted = collections.Counter(got)
        duplicates = {key: n for key, n in counted.items() if n > 1}
        assert not duplicates, sorted(duplicates)[:10]
        assert counted == reference
        assert len(got) == trickled + 24 * 20 + 500 + 300
        return batches

    batches = asyncio.run(main())
    print(f"ring batches read before the fallback: {batches}")
    saved = json.loads(state_file.read_text())
    assert all(len(s["consistent_points"]) <= CONSISTENT_POINTS_MAX for s in saved.values())
