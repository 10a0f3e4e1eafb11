"""The node launcher every suite uses (``changefeed.cli.node_process``): start, clean stop, crash,
restart on the same port, failures that say why, and nothing left running."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from changefeed.cli.node_process import HOST, NodeProcess, stop_all
from support.clients import kv_connect
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(120)


async def roundtrip(node: NodeProcess, key: bytes, value: bytes | None = None) -> bytes:
    async with await kv_connect(node) as kv:
        if value is not None:
            await kv.upsert(key, value, durability="persist")
        return (await kv.get(key)).value


def test_restart_keeps_port_and_data(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=2)
    port, first_pid = node.port, node.pid
    assert node.alive and port > 0
    assert node.address == f"{HOST}:{port}"
    assert node.command()[node.command().index("--host") + 1] == HOST  # loopback only
    asyncio.run(roundtrip(node, b"k", b"v1"))

    node.restart(clean=True)
    assert (node.port, node.starts) == (port, 2)
    assert node.pid != first_pid
    assert asyncio.run(roundtrip(node, b"k")) == b"v1"

    assert node.stop() == 0
    assert not node.alive
    assert node.stop() == 0  # already stopped: the same code, nothing sent
    assert node.errors_in_log() == []
    assert node.log_text().count("=== start #") == 2


def test_kill_is_a_crash_and_the_node_comes_back(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=2)
    asyncio.run(roundtrip(node, b"k", b"persisted"))
    node.kill()
    assert not node.alive
    assert node.stop(check=True) == -signal.SIGKILL  # already dead: returned, not checked
    node.start()
    assert asyncio.run(roundtrip(node, b"k")) == b"persisted"


def test_copy_and_restore_need_a_stopped_node(nodes: NodeFactory, tmp_path: Path) -> None:
    node = nodes(vbuckets=2)
    asyncio.run(roundtrip(node, b"k", b"old"))
    with pytest.raises(RuntimeError, match="stopped node"):
        node.copy_data(tmp_path / "copy")
    node.snapshot_data(tmp_path / "snapshot")  # a running node: frozen meanwhile
    assert node.alive
    node.stop()
    node.copy_data(tmp_path / "copy")
    node.start()
    asyncio.run(roundtrip(node, b"k", b"new"))
    node.stop()
    node.restore_data(tmp_path / "copy")
    node.start()
    assert asyncio.run(roundtrip(node, b"k")) == b"old"


def test_a_failed_start_says_why(nodes: NodeFactory, tmp_path: Path) -> None:
    node = nodes(start=False, args=["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(RuntimeError, match=r"exited with 2 before it was ready(.|\n)*missing"):
        node.start()
    assert not node.alive


def test_leaving_a_with_block_stops_the_node(tmp_path: Path) -> None:
    with NodeProcess(tmp_path / "ok", vbuckets=2) as node:
        assert node.alive
    assert not node.alive and node.process is not None and node.process.returncode == 0

    failing = NodeProcess(tmp_path / "failing", vbuckets=2)
    with pytest.raises(ValueError, match="boom") as failure, failing:
        raise ValueError("boom")
    assert not failing.alive
    assert any("was running" in note for note in failure.value.__notes__)


def test_stop_all_stops_what_is_left(tmp_path: Path) -> None:
    started = [NodeProcess(tmp_path / f"n{i}", vbuckets=2).start() for i in range(2)]
    try:
        assert set(stop_all()) >= set(started)
        assert not any(node.alive for node in started)
    finally:
        for node in started:
            node.kill()
