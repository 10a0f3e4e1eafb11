"""Node configuration: every key either works or is refused by name; the bucket uses the sizes
and the one clock it is given."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.kv import StoreCommand
from changefeed.protocol.opcode import Opcode
from changefeed.server.bucket import Bucket
from changefeed.server.config import ConfigError, NodeConfig, load_config


@pytest.mark.parametrize("key", ["checkpoint_max_items", "flush_batch_items", "extra", "prot"])
def test_keys_that_did_nothing_are_refused_by_name(tmp_path: Path, key: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"[node]\n{key} = 5\n")
    with pytest.raises(ConfigError, match=f"unknown config key '{key}' in {path}"):
        load_config(path)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('vbuckets = "64"', "vbuckets"),
        ("durable = 1", "durable"),
        ("port = true", "port"),
        ("flush_batch_bytes = 0", "flush_batch_bytes"),
        ("checkpoint_max_bytes = -1", "checkpoint_max_bytes"),
        ("noop_idle_timeout_s = 0", "noop_idle_timeout_s"),
    ],
)
def test_wrong_values_are_refused_naming_the_key(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"{line}\n")
    with pytest.raises(ConfigError, match=key):
        load_config(path)


def test_file_values_and_flags_are_layered(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('data_dir = "d"\nnoop_idle_timeout_s = 5\nflush_batch_bytes = 1024\n')
    config = load_config(path, flush_batch_bytes=2048, port=None)
    assert config.data_dir == Path("d")
    assert config.noop_idle_timeout_s == 5
    assert config.flush_batch_bytes == 2048
    assert config.port == NodeConfig().port


def test_flush_batch_bytes_reaches_the_flusher(tmp_path: Path) -> None:
    config = load_config(None, data_dir=tmp_path, vbuckets=1, durable=False, flush_batch_bytes=1)
    bucket = Bucket.open(config)
    try:
        vbucket = bucket.vbucket(0)
        for n in range(5):
            vbucket.set(b"k%d" % n, b"v")
        assert [vbucket.flusher.flush_batch() for _ in range(6)] == [1, 1, 1, 1, 1, 0]
    finally:
        vbucket.close()
        bucket.store.close()


def test_relative_expiry_uses_the_bucket_clock(tmp_path: Path) -> None:
    now = [1_000_000.0]
    config = NodeConfig(data_dir=tmp_path, vbuckets=1, durable=False)
    bucket = Bucket.open(config, clock=lambda: now[0], rng=random.Random(1))
    try:
        command = StoreCommand(Opcode.SET, 0, 1, b"key", b"value", expiry=10)
        bucket.store_command(command)
        assert bucket.get(0, b"key").expiry == 1_000_010  # relative: from the bucket's clock
        now[0] += 11
        with pytest.raises(KeyNotFoundError):
            bucket.get(0, b"key")
    finally:
        bucket.vbucket(0).close()
        bucket.store.close()


def test_the_bucket_flush_loop_persists_in_the_background(tmp_path: Path) -> None:
    """The one flush loop of a node (Flusher has none of its own) persists what is queued."""
    config = NodeConfig(data_dir=tmp_path, vbuckets=2, durable=False)

    async def scenario() -> tuple[bool, int]:
        bucket = Bucket.open(config)
        bucket.start()
        result = bucket.store_command(StoreCommand(Opcode.SET, 1, 1, b"key", b"value"))
        persisted = await bucket.vbucket(1).flusher.wait_persisted(result.seqno, 5.0)
        await bucket.close()
        return persisted, result.seqno

    persisted, seqno = asyncio.run(scenario())
    assert persisted
    reopened = Bucket.open(config)
    try:
        assert reopened.vbucket(1).persisted_seqno == seqno
        assert reopened.get(1, b"key").value == b"value"
    finally:
        for vbucket in reopened.vbuckets.values():
            vbucket.close()
        reopened.store.close()
