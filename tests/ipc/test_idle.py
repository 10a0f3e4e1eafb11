"""Free when unused (issue 27, item 3): with no reader the node publishes nothing per change.

A node with ``--shm`` and no reader pauses its groups after IDLE_AFTER_S: changes written then
add no batch (only a gap batch every REFRESH_S that moves the ring's head on). A reader that
subscribes later resumes publishing; a reader from its saved position (here: the beginning)
gets every change exactly once (the paused stretch over DCP), and a reader from "now" every
change after it; when the last leaves, publishing pauses again.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path

from changefeed.consumer import ClientConfig
from changefeed.ipc.local_stream import LocalStream, high_seqnos, services_of
from changefeed.ipc.stats import inspect
from changefeed.server.shm_publisher import IDLE_AFTER_S, REFRESH_S
from ipc.test_node_wiring import dcp_rows, load, shm_node
from support.nodes import NodeFactory

Key = tuple[int, int, str]


def wait_for_log(node: object, text: str, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while node.log_tail(400).count(text) < count:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{count} x {text!r} not logged"
        time.sleep(0.05)


def heads(port: int, ipc_dir: Path) -> list[float]:
    return [inspect(s, str(ipc_dir))["head_seq"] for s in services_of("default", port, ipc_dir)]


async def read_to(streams: list[LocalStream], ends: dict[int, int], got: list[Key]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not all(
        s.session is not None and s.session.get(vb).seqno >= ends[vb]
        for s in streams
        for vb in s.group
    ):
        assert loop.time() < deadline, [s.stats for s in streams]
        for local in streams:
            batch = await local.next_batch(0.01)
            if batch is not None:
                names = ("vbucket", "seqno", "key", "op")
                columns = [batch.column(c).to_pylist() for c in names]
                got.extend(
                    (vb, seqno, key)
                    for vb, seqno, key, op in zip(*columns, strict=True)
                    if op != "rollback"
                )


def test_no_reader_no_batches_then_readers_get_everything(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path)
    wait_for_log(node, "publishing paused", 2, timeout_s=IDLE_AFTER_S + 10)  # both groups
    before = heads(node.port, ipc_dir)
    started = time.monotonic()
    asyncio.run(load(node.port, 3000, prefix="idle"))
    time.sleep(REFRESH_S + 0.5)
    deadline = time.monotonic() + 30  # the flush that persists the load is slow under load
    while True:  # bounded by the deadline
        elapsed = time.monotonic() - started
        now = heads(node.port, ipc_dir)
        grown = [after - first for first, after in zip(before, now, strict=True)]
        if all(g >= 1 for g in grown) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # no batch per change: only the refresh gaps (one a REFRESH_S at most, per group)
    assert all(g <= elapsed / REFRESH_S + 2 for g in grown), (grown, elapsed)
    assert all(g >= 1 for g in grown), grown  # the head moved on to what was persisted

    async def main() -> tuple[list[Key], list[Key]]:
        config = ClientConfig(port=node.port)
        services = services_of("default", node.port, ipc_dir)
        everything = [
            LocalStream(s, directory=ipc_dir, app_id=1, start="beginning", dcp=config)
            for s in services
        ]
        from_now = [
            LocalStream(s, directory=ipc_dir, app_id=2, start="now", dcp=config) for s in services
        ]
        all_rows: list[Key] = []
        new_rows: list[Key] = []
        try:
            await load(node.port, 1000, prefix="live")
            ends = await high_seqnos(config)
            await read_to(everything, ends, all_rows)
            await read_to(from_now, ends, new_rows)
            assert sum(s.stats["shm_rows"] for s in everything + from_now) > 0  # resumed
        finally:
            for local in everything + from_now:
                local.close()
        return all_rows, new_rows

    all_rows, new_rows = asyncio.run(main())
    reference = sorted((vb, seqno, key) for vb, seqno, key, *_ in asyncio.run(dcp_rows(node.port)))
    assert len(reference) == 4000
    assert not [k for k, n in collections.Counter(all_rows).items() if n > 1]
    assert sorted(all_rows) == reference
    # from "now": every change written after it, once (and none it started after)
    assert not [k for k, n in collections.Counter(new_rows).items() if n > 1]
    assert set(new_rows) <= set(reference)
    assert {key for _, _, key in new_rows if key.startswith("live")} == {
        f"live{i}" for i in range(1000)
    }
    wait_for_log(node, "publishing resumed", 2)
    wait_for_log(node, "publishing paused", 4, timeout_s=IDLE_AFTER_S + 10)  # readers gone
