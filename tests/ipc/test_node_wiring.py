"""The real node (``changefeed serve --shm``) publishing into shared memory, read by local
readers: the same rows as DCP, a slow reader going over DCP and back, a node killed with -9."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from changefeed.consumer import Changes, ClientConfig, DcpClient, KvClient, StreamEnded
from changefeed.consumer.kv_client import Durability
from changefeed.ipc import LostDataError
from changefeed.ipc.local_stream import LocalStream, high_seqnos, services_of
from changefeed.ipc.segments import Segment, ServicePaths
from support.nodes import NodeFactory

VBUCKETS = 8
Row = tuple[int, int, str, str, bytes]


def shm_node(nodes: NodeFactory, ipc_dir: Path, tmp_path: Path, **settings: Any) -> Any:
    config = tmp_path / "shm.toml"
    lines = [f'shm_dir = "{ipc_dir}"', "shm_groups = 2"]
    lines += [f"{key} = {value}" for key, value in settings.items()]
    config.write_text("\n".join(lines) + "\n")
    return nodes(vbuckets=VBUCKETS, args=["--config", str(config), "--no-durable"])


async def load(
    port: int, count: int, *, prefix: str = "k", size: int = 100, durability: Durability = "none"
) -> None:
    async with await KvClient.connect("127.0.0.1", port) as kv:
        for start in range(0, count, 500):
            await asyncio.gather(
                *(
                    kv.upsert(f"{prefix}{i}".encode(), b"v" * size, durability=durability)
                    for i in range(start, min(count, start + 500))
                )
            )


async def dcp_rows(port: int) -> set[Row]:
    """Every change on the node now, over DCP (the reference)."""
    rows: set[Row] = set()
    async with DcpClient(ClientConfig(port=port, to_latest=True)) as client:
        await client.stream(list(range(VBUCKETS)))
        ended = 0
        async for event in client.events():
            if isinstance(event, Changes):
                cols = event.columns
                ops = {0x57: "mutation", 0x58: "deletion", 0x59: "expiration"}
                for i in range(len(cols)):
                    rows.add(
                        (
                            cols.vbucket[i],
                            cols.seqno[i],
                            cols.key[i].decode(),
                            ops[cols.opcode[i]],
                            cols.value[i],
                        )
                    )
            elif isinstance(event, StreamEnded):
                ended += 1
                if ended == VBUCKETS:
                    return rows
    return rows


def as_rows(batch: pa.RecordBatch) -> set[Row]:
    columns = [
        batch.column(name).to_pylist() for name in ("vbucket", "seqno", "key", "op", "value")
    ]
    return set(zip(*columns, strict=True))


async def read_until(
    streams: list[LocalStream],
    ends: dict[int, int] | asyncio.Future[dict[int, int]],
    timeout_s: float = 30.0,
) -> set[Row]:
    """Rows from `streams` until every vbucket reached `ends` (known now, or later)."""
    rows: set[Row] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        for local in streams:
            batch = await local.next_batch(0.02)
            if batch is not None:
                rows |= as_rows(batch)
        if isinstance(ends, asyncio.Future):
            if not ends.done():
                continue
            ends = ends.result()
        done = all(
            local.session is not None and local.session.get(vb).seqno >= ends.get(vb, 0)
            for local in streams
            for vb in local.group
        )
        if done:
            return rows
        assert loop.time() < deadline, [local.session for local in streams]


async def load_and_read(
    streams: list[LocalStream], port: int, count: int, **kwargs: Any
) -> set[Row]:
    """Load `count` documents while reading them (as a live reader does)."""
    ends: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()
    reading = asyncio.create_task(read_until(streams, ends))
    await load(port, count, **kwargs)
    ends.set_result(await high_seqnos(ClientConfig(port=port)))
    return await reading


def open_streams(port: int, ipc_dir: Path, **kwargs: Any) -> list[LocalStream]:
    services = services_of("default", port, ipc_dir)
    assert services == [f"default-{port}-g0", f"default-{port}-g1"]
    return [LocalStream(service, directory=ipc_dir, **kwargs) for service in services]


def test_the_node_publishes_each_group_and_readers_get_what_dcp_gets(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path)

    async def main() -> None:
        config = ClientConfig(port=node.port)
        live = open_streams(node.port, ipc_dir, app_id=1)  # from now: the ring only
        late = None
        try:
            assert [s.group for s in live] == [(0, 1, 2, 3), (4, 5, 6, 7)]
            got = await load_and_read(live, node.port, 3000)
            reference = await dcp_rows(node.port)
            assert got == reference and len(got) == 3000
            assert sum(s.stats["dcp_rows"] for s in live) == 0
            assert sum(s.stats["shm_rows"] for s in live) == 3000
            for local in live:
                local.close()
            for i in range(40):  # one batch each: the ring (16 slots) no longer holds seq 1
                # persisted before the next: a flush round each (rows publish once persisted)
                await load(node.port, 1, prefix=f"w{i}-", durability="persist")
            # A reader from the beginning: over DCP up to the ring, then the ring.
            late = open_streams(node.port, ipc_dir, app_id=2, start="beginning", dcp=config)
            got = await load_and_read(late, node.port, 1000, prefix="m")
            assert got == await dcp_rows(node.port)
            assert all(s.stats["dcp_rows"] > 0 and s.stats["rejoins"] >= 1 for s in late)
            assert sum(s.stats["dcp_rows"] + s.stats["shm_rows"] for s in late) == 4040
        finally:
            for local in live + (late or []):
                local.close()  # idempotent

    asyncio.run(main())
    node.stop()
    for index in (0, 1):  # stopped with no reader attached: nothing left behind
        paths = ServicePaths(f"default-{node.port}-g{index}", ipc_dir)
        assert not Segment.exists(paths.control_segment)
    assert not list(ipc_dir.iterdir())


def test_a_reader_behind_the_ring_resumes_over_dcp_and_rejoins(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path, shm_slots=4, shm_max_subscribers=2)

    async def main() -> None:
        config = ClientConfig(port=node.port)
        streams = open_streams(node.port, ipc_dir, app_id=1, dcp=config)
        try:
            for i in range(20):  # a flush round each (persisted first): far more than 4 slots
                await load(node.port, 200, prefix=f"k{i}-", durability="persist")
            ends = await high_seqnos(config)
            got = await read_until(streams, ends)
            assert got == await dcp_rows(node.port)
            assert all(s.stats["lost"] >= 1 and s.stats["dcp_rows"] > 0 for s in streams), [
                s.stats for s in streams
            ]
            await load(node.port, 200, prefix="after")  # back on the ring
            before = [s.stats["shm_rows"] for s in streams]
            ends = await high_seqnos(config)
            got |= await read_until(streams, ends)
            assert got == await dcp_rows(node.port)
            assert sum(s.stats["shm_rows"] for s in streams) > sum(before)
            assert all(s.stats["rejoins"] >= 1 for s in streams), [s.stats for s in streams]
        finally:
            for local in streams:
                local.close()

    asyncio.run(main())


def test_kill_the_node_while_readers_read(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    """kill -9 the node; restarted, it reuses the segments the readers hold and continues the
    ring: the readers (no DCP fallback: any gap would raise) get every change exactly once."""
    node = shm_node(nodes, ipc_dir, tmp_path)

    async def main() -> None:
        streams = open_streams(node.port, ipc_dir, app_id=1)  # dcp=None: a gap raises
        got: set[Row] = set()
        try:
            got |= await load_and_read(streams, node.port, 2000)
            node.kill()
            for local in streams:  # the readers wait; nothing new, nothing broken
                assert await local.next_batch(0.2) is None
            node.start()
            log = node.log_tail(40)
            assert log.count("(reused, head seq") == 2, log
            got |= await load_and_read(streams, node.port, 2000, prefix="second")
            assert got == await dcp_rows(node.port)
            assert len(got) == 4000
        except LostDataError as error:  # pragma: no cover - what the test guards against
            pytest.fail(f"a gap after the node restart: {error}")
        finally:
            for local in streams:
                local.close()

    asyncio.run(main())


def test_changefeed_stream_local(nodes: NodeFactory, ipc_dir: Path, tmp_path: Path) -> None:
    """``changefeed stream --local`` writes the changes DCP has, and a state file that resumes
    over either transport."""
    node = shm_node(nodes, ipc_dir, tmp_path)
    asyncio.run(load(node.port, 1500))
    base = [sys.executable, "-m", "changefeed", "stream", "--port", str(node.port), "--to-latest"]
    local = [*base, "--local", "--shm-dir", str(ipc_dir)]
    out, state = tmp_path / "local.jsonl", tmp_path / "state.json"
    done = subprocess.run(
        [*local, "--output", str(out), "--state", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(d["vb"], d["seqno"], d["key"]) for d in lines} == {
        (vb, seqno, key) for vb, seqno, key, _, _ in asyncio.run(dcp_rows(node.port))
    }
    asyncio.run(load(node.port, 500, prefix="more"))
    again = subprocess.run(
        [*local, "--output", str(out), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert len(out.read_text().splitlines()) == 2000  # the 500 new ones, each once
    # The state resumes a TCP stream too: nothing new there.
    tcp = subprocess.run(
        [*base, "--output", str(out), "--state", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tcp.returncode == 0, tcp.stderr
    assert json.loads(tcp.stderr.strip().splitlines()[-1])["changes"] == 0


def test_stream_local_names_what_is_not_published(nodes: NodeFactory, ipc_dir: Path) -> None:
    node = nodes(vbuckets=VBUCKETS)  # no --shm
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "changefeed",
            "stream",
            "--port",
            str(node.port),
            "--local",
            "--shm-dir",
            str(ipc_dir),
            "--to-latest",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "vbuckets 0-7" in done.stderr and "not published over shared memory" in done.stderr
