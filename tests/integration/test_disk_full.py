"""Disk full on a real filesystem: a node whose data directory sits on a small tmpfs.

Before: the first failed commit killed the flush task silently, non-durable writes kept being
acknowledged and were lost, `persist` writes only timed out, freeing space did not resume
persistence and SIGTERM exited 1. Now: writes are refused with TMPFAIL while the store cannot
persist, a persistence wait gets the error, the flusher resumes by itself once space returns,
shutdown is clean, and every write the node acknowledged is there after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import KvClient
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.protocol.kv import MutationResult
from support.clients import kv_connect, node_stats

TMPFS_BYTES = 48 * 1024 * 1024
VALUE = b"v" * 1000
FILL_CHUNK = b"\0" * (1024 * 1024)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> Path:
    """Write a filler file until the filesystem is full; return it (delete it to free space)."""
    filler = path / "filler"
    for chunk in (FILL_CHUNK, b"\0" * 4096):  # megabytes, then the last pages
        with contextlib.suppress(OSError), open(filler, "ab", buffering=0) as handle:
            while True:  # bounded by the tmpfs size: ENOSPC ends it
                handle.write(chunk)
    return filler


async def general_stats(node: NodeProcess) -> dict[str, str]:
    return await node_stats(node)


async def write_until_refused(
    kv: KvClient, acked: dict[bytes, bytes], limit: int
) -> MutationResult:
    """Write new keys until the node refuses one with TMPFAIL; return the last acknowledged."""
    last: MutationResult | None = None
    for n in range(limit):  # bounded by limit
        key = b"after-full-%06d" % n
        try:
            last = await kv.upsert(key, VALUE)
        except TemporaryFailureError:
            assert last is not None, "the first write after filling the disk was refused"
            return last
        acked[key] = VALUE
        await asyncio.sleep(0.002)
    raise AssertionError(f"{limit} writes acknowledged on a full disk; none refused")


def test_disk_full_refuses_writes_resumes_and_loses_nothing_acknowledged(
    small_disk: Path,
) -> None:
    node = NodeProcess(small_disk / "node", vbuckets=4)
    node.start()
    acked: dict[bytes, bytes] = {}
    try:

        async def scenario() -> None:
            kv = await kv_connect(node)
            try:
                for n in range(200):
                    key = b"before-%04d" % n
                    await kv.upsert(key, VALUE, durability="persist")
                    acked[key] = VALUE
                filler = fill(small_disk)
                unpersisted = await write_until_refused(kv, acked, limit=20_000)
                general = await general_stats(node)
                assert general["persistence_failing"] == "1", general
                assert int(general["persistence_failures_total"]) >= 1, general
                assert general["persistence_error"], general
                started = time.monotonic()  # a persistence wait gets the error, not a timeout
                with pytest.raises(TemporaryFailureError, match="cannot persist"):
                    await kv.wait_persisted(unpersisted, timeout_s=30)
                with pytest.raises(TemporaryFailureError, match="cannot persist"):
                    await kv.upsert(b"durable-on-full", VALUE, durability="persist")
                assert time.monotonic() - started < 10
                filler.unlink()  # space returns: the flusher must notice by itself
                deadline = time.monotonic() + 30
                while (await general_stats(node))["persistence_failing"] != "0":
                    assert time.monotonic() < deadline, "persistence did not resume"
                    await asyncio.sleep(0.2)
                for n in range(100):
                    key = b"after-free-%04d" % n
                    await kv.upsert(key, VALUE, durability="persist")
                    acked[key] = VALUE
            finally:
                await kv.close()

        asyncio.run(scenario())
        assert "cannot persist" in node.log_text()
        assert node.stop() == 0  # an orderly shutdown, exit 0
        node.start()

        async def verify() -> None:
            kv = await kv_connect(node)
            try:
                missing = [key for key in acked if (await kv.get(key)).value != acked[key]]
            finally:
                await kv.close()
            assert not missing, f"{len(missing)} of {len(acked)} acknowledged writes lost"

        asyncio.run(verify())
    finally:
        if node.alive:
            node.stop(check=False)
        node.kill()
